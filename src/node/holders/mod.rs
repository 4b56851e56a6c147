//! Who still uses a published volume: processes on the node whose mount namespace holds a
//! mount of it (a task's namespace keeps the filesystem alive after the host's mount is
//! gone, and the host's unmount does not fail for it), or that hold a file, a working
//! directory, a root, an executable or a mapping on it. Like the kubelet's "device in use"
//! checks, this reads the kernel (`/proc/<pid>/mountinfo`, `fdinfo`, `cwd`, `root`, `exe`,
//! `maps`), never the agent's records.
//!
//! Files are matched by mount ID (`mnt_id` in fdinfo, proc(5)), unique across namespaces,
//! so a bind of a subdirectory of the same disk elsewhere is never mistaken for the volume.
//! Reading `/proc` costs time in the number of processes and their descriptors: run
//! [`scan_many`] off the agent's loop (a blocking task), only before an unpublish, shared by
//! the unpublishes that wait together ([`before_unpublish_shared`]). The descriptors and
//! mappings are read only for a volume the kernel cannot answer for: one whose only mount
//! anywhere is the target's, and that the kernel finds idle by that mount's reference
//! count ([`crate::node::mounts::busy`]), is free without them.

use crate::node::identity::{self, NodeCgroups, Whose};
use crate::node::mounts::{DeviceId, MountIdentity, MountTable};
use serde::Serialize;
pub mod exits;
mod procfs;

use procfs::{comm_of, gone, inspect_all, pids, report, without_kernel_threads};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
#[cfg(test)]
use std::path::Path;
use std::path::PathBuf;

/// Why the scan could not be made at all.
#[derive(Debug, thiserror::Error)]
pub enum HoldersError {
    /// `/proc` itself could not be listed.
    #[error("cannot list processes in /proc: {0} (is /proc mounted?)")]
    Proc(#[source] std::io::Error),
    /// The host's mount table could not be read.
    #[error(transparent)]
    Mounts(#[from] crate::node::mounts::MountsError),
}

/// What an unpublish of `target` must wait for: `None` when nothing is mounted there,
/// else who uses the mount on top of it (read from the host's table now). Blocking: call
/// it from a blocking task, just before the plugin's `unpublish`. (The agent uses
/// [`before_unpublish_shared`].)
#[cfg(test)]
pub fn before_unpublish(target: &Path) -> Result<Option<Usage>, HoldersError> {
    let host = MountTable::read()?;
    let Some(top) = host.top_at(target) else {
        return Ok(None);
    };
    let id = top.identity();
    scan(&id, target, &host).map(Some)
}

/// [`before_unpublish`] for each of `targets` from one read of the host's table and one
/// pass over `/proc` ([`scan_many`]), in order.
pub fn before_unpublish_many(targets: &[PathBuf]) -> Result<Vec<Option<Usage>>, HoldersError> {
    let host = MountTable::read()?;
    let mut wanted = Vec::new();
    let mut slots = Vec::with_capacity(targets.len());
    for t in targets {
        slots.push(host.top_at(t).map(|top| {
            wanted.push((top.identity(), t.clone()));
            wanted.len() - 1
        }));
    }
    let mut usages: Vec<Option<Usage>> = scan_many(&wanted, &host, identity::node())?
        .into_iter()
        .map(Some)
        .collect();
    Ok(slots
        .into_iter()
        .map(|slot| slot.and_then(|i| usages.get_mut(i).and_then(Option::take)))
        .collect())
}

/// Where a waiting unpublish gets its scan's answer (an error as its message: one scan's
/// error answers every call of its batch).
type Answer = tokio::sync::oneshot::Sender<Result<Option<Usage>, String>>;

/// Unpublishes waiting for a scan, and whether a scan was started that has not taken
/// them yet.
#[derive(Default)]
struct Waiting {
    queue: Vec<(PathBuf, Answer)>,
    starting: bool,
}

static WAITING: std::sync::Mutex<Waiting> = std::sync::Mutex::new(Waiting {
    queue: Vec::new(),
    starting: false,
});

/// [`before_unpublish`] shared by the unpublishes that wait at the same time: every call
/// gets the result of a scan that started after it was made (never an older one). A call
/// joins the scan that was started but has not begun yet, else starts one at once, also
/// while others run: it waits one scan, not the rest of a running one plus its own. A
/// wave of N unpublishes (a job of N allocations stopped) costs a few passes over `/proc`
/// instead of N, each of them O(processes); at most one scan per call in flight, so at
/// most `--max-parallel` at once (docs/scale.md). On a multi-threaded runtime the scan
/// runs on the calling worker (`block_in_place`), after one yield that lets the calls
/// made at the same moment join it.
pub async fn before_unpublish_shared(target: PathBuf) -> Result<Option<Usage>, HoldersError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let start = {
        let mut w = WAITING.lock().unwrap_or_else(|e| e.into_inner());
        w.queue.push((target, tx));
        !std::mem::replace(&mut w.starting, true)
    };
    if start {
        // On the runtime's own worker when it has others to take over (the agent's
        // multi-threaded runtime): no hand-over to a blocking thread and back, each a
        // wake-up of another thread, on the path from one unpublish to the next. The
        // calls made at the same moment (a wave's first slots) join it while it yields
        // once; if this call is dropped before it scans, a blocking thread scans for them.
        if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
        {
            let mut owed = ScanOwed(true);
            tokio::task::yield_now().await;
            owed.0 = false;
            tokio::task::block_in_place(scan_waiting);
        } else {
            tokio::task::spawn_blocking(scan_waiting);
        }
    }
    match rx.await {
        Ok(r) => r.map_err(|e| HoldersError::Proc(std::io::Error::other(e))),
        Err(_) => Err(HoldersError::Proc(std::io::Error::other(
            "the scan for processes using the volume ended without an answer",
        ))),
    }
}

/// A scan this call announced (`starting`) and has not run yet: run on a blocking thread
/// if the call is dropped, so the calls that joined it are answered.
struct ScanOwed(bool);

impl Drop for ScanOwed {
    fn drop(&mut self) {
        if self.0 {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn_blocking(scan_waiting)),
                Err(_) => drop(std::thread::spawn(scan_waiting)),
            }
        }
    }
}

/// Answers the calls waiting when it begins, with one scan; calls made after that start
/// another.
fn scan_waiting() {
    let batch = {
        let mut w = WAITING.lock().unwrap_or_else(|e| e.into_inner());
        w.starting = false;
        std::mem::take(&mut w.queue)
    };
    if batch.is_empty() {
        return;
    }
    let targets: Vec<PathBuf> = batch.iter().map(|(t, _)| t.clone()).collect();
    #[cfg(test)]
    BATCHES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(targets.clone());
    match before_unpublish_many(&targets) {
        Ok(usages) => {
            for ((_, tx), usage) in batch.into_iter().zip(usages) {
                let _ = tx.send(Ok(usage));
            }
        }
        Err(e) => {
            let e = e.to_string();
            for (_, tx) in batch {
                let _ = tx.send(Err(e.clone()));
            }
        }
    }
}

/// The targets of each scan [`before_unpublish_shared`] made (tests count the scans that
/// answered their own calls).
#[cfg(test)]
static BATCHES: std::sync::Mutex<Vec<Vec<PathBuf>>> = std::sync::Mutex::new(Vec::new());

/// How a process holds the volume.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Hold {
    /// Its mount namespace (not the host's) has the volume mounted here.
    Mount { mount_point: PathBuf },
    /// An open file descriptor on the volume.
    OpenFile { fd: u32, path: PathBuf },
    /// Its working directory is on the volume.
    Cwd,
    /// Its root directory is on the volume.
    Root,
    /// It runs an executable from the volume.
    Exe,
    /// It maps a file of the volume into memory.
    Mapped { path: PathBuf },
}

/// A process holding the volume.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Holder {
    pub pid: u32,
    /// `/proc/<pid>/comm` (the name the kernel shows, at most 15 bytes).
    pub comm: String,
    pub how: Hold,
    /// The allocation whose task it is, from its cgroup (`crate::node::identity`: the task's
    /// cgroup names it), if it runs in one of this node's task cgroups. Never from its
    /// environment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc_id: Option<String>,
    /// It runs in a cgroup of another node simulated on this host (`--other-node-cgroup`):
    /// not this node's process.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub other_node: bool,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({})", self.pid, self.comm)?;
        if let Some(a) = &self.alloc_id {
            write!(f, " of allocation {a}")?;
        }
        if self.other_node {
            write!(f, " of another node")?;
        }
        match &self.how {
            Hold::Mount { mount_point } => {
                write!(f, " has it mounted at {}", mount_point.display())
            }
            Hold::OpenFile { fd, path } => write!(f, " has {} open (fd {fd})", path.display()),
            Hold::Cwd => write!(f, " works in it"),
            Hold::Root => write!(f, " is chrooted in it"),
            Hold::Exe => write!(f, " runs a program from it"),
            Hold::Mapped { path } => write!(f, " maps {}", path.display()),
        }
    }
}

/// A process whose use of the volume could not be read (EACCES: an LSM or a process with
/// more capabilities than the agent).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Uninspected {
    pub pid: u32,
    pub comm: String,
    /// Which part could not be read (`mountinfo`, `fd`, `cwd`...).
    pub what: &'static str,
    /// Why (the error's message).
    pub error: String,
}

/// The result of a scan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Processes using the volume, by pid.
    pub holders: Vec<Holder>,
    /// Mounts of the same content in the host's namespace besides the target (a bind of
    /// it made elsewhere, or the same export mounted again). Reported, not counted: a
    /// mount is no process, and processes using it are found through their files.
    pub other_mounts: Vec<PathBuf>,
    /// Processes (or parts of them) that could not be read. A process whose mount table
    /// cannot be read may hide a mount of the volume: see [`Usage::in_use`].
    pub uninspected: Vec<Uninspected>,
    /// Processes whose namespace holds a copy of the target's mount that the host's
    /// unmount takes along ([`Reach`]: a peer or slave of it, at the same place, under a
    /// peer or slave of its parent, with nothing mounted on it): a service started with a
    /// namespace of its own after the publish (systemd's `PrivateTmp=`, `ProtectSystem=`
    /// make slave copies of every mount). Reported, not counted: the kernel's unmount removes
    /// such a copy with the host's mount, or fails with EBUSY while it is in use, and
    /// processes using it are found through their files. A fence kills them
    /// (`crate::node::fence`): a remount does not reach a copy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<Holder>,
    /// True when the kernel answered for the host's mount ([`crate::node::mounts::busy`]):
    /// nothing held it, so no process's descriptors or mappings were read.
    #[serde(skip)]
    pub by_kernel: bool,
}

impl Usage {
    /// True when the volume must not be unpublished: a holder, or a process whose mount
    /// table could not be read (it may hold a mount of the volume, and the host's unmount
    /// would not fail for it). Descriptors that could not be read do not count:
    /// descriptors in the host namespace on the target's mount make its unmount fail with
    /// EBUSY, which the plugin reports.
    pub fn in_use(&self) -> bool {
        !self.holders.is_empty() || self.uninspected.iter().any(|u| u.what == "mountinfo")
    }

    /// The processes whose exit can end the refusal: each holder and each process whose
    /// mount table could not be read, by pid, once each ([`exits::all_exited`] waits on them).
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .holders
            .iter()
            .map(|h| h.pid)
            .chain(
                self.uninspected
                    .iter()
                    .filter(|u| u.what == "mountinfo")
                    .map(|u| u.pid),
            )
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Drops the holders in another simulated node's cgroups ([`Holder::other_node`]: the
    /// operator's `--other-node-cgroup`, only set where several nodes share one host).
    pub fn without_other_nodes(mut self) -> Self {
        self.holders.retain(|h| !h.other_node);
        self.copies.retain(|h| !h.other_node);
        self
    }

    /// One line for logs and status: who holds it, the first `max` named.
    pub fn summary(&self, max: usize) -> String {
        let mut parts: Vec<String> = self
            .holders
            .iter()
            .take(max)
            .map(ToString::to_string)
            .collect();
        if self.holders.len() > max {
            parts.push(format!("{} more", self.holders.len() - max));
        }
        parts.extend(
            self.other_mounts
                .iter()
                .map(|p| format!("also mounted at {}", p.display())),
        );
        parts.extend(
            self.uninspected
                .iter()
                .filter(|u| u.what == "mountinfo")
                .map(|u| {
                    format!(
                        "pid {} ({}): mount table unreadable ({})",
                        u.pid, u.comm, u.error
                    )
                }),
        );
        parts.join("; ")
    }
}

/// Finds who uses the volume mounted at `target` with content `volume`, in `host` (the
/// host's table, read just before). The agent's own process is not counted.
#[cfg(test)]
pub fn scan(
    volume: &MountIdentity,
    target: &Path,
    host: &MountTable,
) -> Result<Usage, HoldersError> {
    let mut all = scan_many(
        &[(volume.clone(), target.to_path_buf())],
        host,
        identity::node(),
    )?;
    Ok(all.pop().unwrap_or_default())
}

/// How the host's unmount of a target reaches other namespaces: the kernel's unmount of a
/// mount (fs/namespace.c `do_umount`) also unmounts, at the same mount point, the child of
/// every mount that receives propagation from its parent (fs/pnode.c `propagate_umount`),
/// unless that child has mounts of its own; a non-lazy unmount fails with EBUSY when one of
/// them is in use (`propagate_mount_busy`). Set only when both the target's mount and its
/// parent are shared (the placeholder guard is, `crate::node::guard`).
struct Reach {
    /// The target mount's peer group (`shared:N`).
    group: u32,
    /// Its parent's peer group.
    parent_group: u32,
    /// Where it is mounted.
    mount_point: PathBuf,
}

impl Reach {
    /// The reach of `top`, the mount on top of a target in `host`.
    fn of(host: &MountTable, top: &crate::node::mounts::MountEntry) -> Option<Self> {
        let parent = host.by_id(top.parent)?;
        Some(Self {
            group: top.shared?,
            parent_group: parent.shared?,
            mount_point: top.mount_point().to_path_buf(),
        })
    }

    /// True when `copy`, an entry of another namespace's `table`, is a copy the unmount takes
    /// along: in the target's peer group or a slave of it, at the same mount point, under a
    /// mount in the parent's peer group or a slave of it, with nothing mounted on it.
    fn takes(&self, copy: &crate::node::mounts::MountEntry, table: &MountTable) -> bool {
        let of = |group: u32, e: &crate::node::mounts::MountEntry| {
            e.shared == Some(group) || e.master == Some(group)
        };
        of(self.group, copy)
            && copy.mount_point() == self.mount_point
            && table
                .by_id(copy.parent)
                .is_some_and(|p| of(self.parent_group, p))
            && !table.entries().iter().any(|e| e.parent == copy.id)
    }
}

/// The scan of several volumes in one pass over `/proc` (each process, namespace and
/// descriptor read once): the usage of each `(volume, target)`, in order. Unpublishes that
/// wait together share it ([`before_unpublish_shared`]), so a wave of N unpublishes reads
/// `/proc` once instead of N times.
///
/// Pass 1 reads every other mount namespace's table for copies of the volumes. A volume
/// with no mount but the target's (no copy in another namespace, no other bind in the
/// host's) is then asked of the kernel ([`crate::node::mounts::busy::mount_use`]): every file,
/// directory, mapping or mount on that mount holds a reference to it, so an idle answer
/// is the whole answer ([`Usage::by_kernel`]). Pass 2 (each process's descriptors, working
/// directory, root, executable and mappings: about 60 system calls a process) runs only
/// for the other volumes, to name who holds them.
pub fn scan_many(
    wanted: &[(MountIdentity, PathBuf)],
    host: &MountTable,
    node: &NodeCgroups,
) -> Result<Vec<Usage>, HoldersError> {
    let me = std::process::id();
    let mut usages: Vec<Usage> = Vec::with_capacity(wanted.len());
    // Every mount of each volume in every namespace, by ID: what descriptors may point at.
    let mut volume_mounts: Vec<BTreeSet<u32>> = Vec::with_capacity(wanted.len());
    // The ID of each target's mount, where it shows the volume.
    let mut target_mounts: Vec<Option<u32>> = Vec::with_capacity(wanted.len());
    // How far the host's unmount of each target reaches.
    let mut reach: Vec<Option<Reach>> = Vec::with_capacity(wanted.len());
    for (volume, target) in wanted {
        let top = host.top_at(target).filter(|e| e.shows(volume));
        reach.push(top.and_then(|top| Reach::of(host, top)));
        let target_mount = top.map(|e| e.id);
        target_mounts.push(target_mount);
        usages.push(Usage {
            other_mounts: host
                .entries()
                .iter()
                .filter(|e| e.shows(volume) && Some(e.id) != target_mount)
                .map(|e| e.mount_point().to_path_buf())
                .collect(),
            ..Usage::default()
        });
        volume_mounts.push(
            host.entries()
                .iter()
                .filter(|e| e.shows(volume))
                .map(|e| e.id)
                .collect(),
        );
    }
    // Namespaces whose table is `host` or needs no reading: pid 1's (`host` is its table,
    // `mounts::HOST_MOUNTINFO`) and the agent's own.
    let ns_of = |pid: &str| {
        std::fs::metadata(format!("/proc/{pid}/ns/mnt"))
            .ok()
            .map(|m| m.ino())
    };
    let host_ns: BTreeSet<u64> = [ns_of("1"), ns_of("self")].into_iter().flatten().collect();

    // Pass 1: mount namespaces. Per namespace, the mount points of each volume in it, each
    // with whether the host's unmount takes it along ([`Reach::takes`]).
    let mut procs: Vec<u32> = Vec::new();
    let mut by_ns: BTreeMap<u64, Vec<Vec<(PathBuf, bool)>>> = BTreeMap::new();
    let none = || vec![Vec::new(); wanted.len()];
    // Kernel threads (most entries of `/proc` on a typical node) hold nothing: no
    // descriptors, mappings or working directory of their own, and the initial mount
    // namespace, whose table is `host`.
    for pid in without_kernel_threads(pids()?) {
        if pid == me {
            continue;
        }
        let ns = ns_of(&pid.to_string());
        let here: Vec<Vec<(PathBuf, bool)>> = match ns.and_then(|ns| by_ns.get(&ns)) {
            Some(points) => points.clone(),
            // Pid 1, whose table `host` is (also when its namespace link cannot be read,
            // as under some init systems), and the host's and the agent's namespaces:
            // nothing to read again.
            None if pid == 1 => none(),
            None if ns.is_some_and(|ns| host_ns.contains(&ns)) => {
                by_ns.insert(ns.unwrap_or_default(), none());
                none()
            }
            None => match MountTable::read_pid(pid) {
                Ok(t) if ns.is_none() && crate::node::host::same_namespace(host, &t) => none(),
                Ok(t) => {
                    let points: Vec<Vec<(PathBuf, bool)>> = wanted
                        .iter()
                        .zip(volume_mounts.iter_mut())
                        .zip(&reach)
                        .map(|(((volume, _), mounts), reach)| {
                            let mine: Vec<&crate::node::mounts::MountEntry> =
                                t.entries().iter().filter(|e| e.shows(volume)).collect();
                            mounts.extend(mine.iter().map(|e| e.id));
                            mine.iter()
                                .map(|e| {
                                    let taken = reach.as_ref().is_some_and(|r| r.takes(e, &t));
                                    (e.mount_point().to_path_buf(), taken)
                                })
                                .collect()
                        })
                        .collect();
                    if let Some(ns) = ns {
                        by_ns.insert(ns, points.clone());
                    }
                    points
                }
                Err(crate::node::mounts::MountsError::Read { source, .. }) if gone(&source) => {
                    continue
                }
                Err(e) => {
                    let comm = comm_of(pid);
                    for usage in &mut usages {
                        usage.uninspected.push(Uninspected {
                            pid,
                            comm: comm.clone(),
                            what: "mountinfo",
                            error: e.to_string(),
                        });
                    }
                    none()
                }
            },
        };
        if here.iter().any(|p| !p.is_empty()) {
            let comm = comm_of(pid);
            for (usage, points) in usages.iter_mut().zip(here) {
                for (mount_point, taken) in points {
                    let h = Holder {
                        pid,
                        comm: comm.clone(),
                        how: Hold::Mount { mount_point },
                        alloc_id: None,
                        other_node: false,
                    };
                    if taken {
                        usage.copies.push(h);
                    } else {
                        usage.holders.push(h);
                    }
                }
            }
        }
        procs.push(pid);
    }

    // The kernel's answer, where it is the whole answer: a volume whose one mount anywhere
    // is the target's (no other namespace holds a copy, no other bind of it stands in the
    // host's) is held by a process exactly when that mount's reference count says so
    // (`mounts::busy`). Those the kernel finds idle need no pass 2.
    let mut slow: Vec<usize> = Vec::with_capacity(wanted.len());
    for (i, (volume, target)) in wanted.iter().enumerate() {
        let idle = match target_mounts[i] {
            Some(id)
                if usages[i].holders.is_empty()
                    && usages[i].uninspected.is_empty()
                    && volume_mounts[i].len() == 1
                    && volume_mounts[i].contains(&id) =>
            {
                crate::node::mounts::busy::mount_use(target, id, volume.dev)
                    == crate::node::mounts::busy::MountUse::Idle
            }
            _ => false,
        };
        if idle {
            usages[i].by_kernel = true;
        } else {
            slow.push(i);
        }
    }

    // Pass 2: what each process holds open, on any of the volumes the kernel did not
    // answer for.
    if !slow.is_empty() {
        let any: BTreeSet<u32> = slow
            .iter()
            .flat_map(|&i| volume_mounts[i].iter().copied())
            .collect();
        let devs: BTreeSet<DeviceId> = slow.iter().map(|&i| wanted[i].0.dev).collect();
        for (pid, seen) in inspect_all(&procs, &any, &devs) {
            if let Some((holds, unread)) = seen {
                report(&mut usages, &volume_mounts, &slow, pid, &holds, &unread);
            }
        }
    }
    // Whose each holder is, from its cgroup (read once per process). A holder gone since it
    // was read (a short-lived child such as a task loop's `sleep`) holds nothing any more;
    // counted, it would be a holder of no allocation, which blocks the unpublish. One whose
    // cgroup cannot be read otherwise is no allocation's and no other node's (fail closed:
    // the fence kills it, it blocks the unpublish).
    let mut whose: BTreeMap<u32, Option<Whose>> = BTreeMap::new();
    let mut identify = |h: &mut Holder| {
        let w = whose
            .entry(h.pid)
            .or_insert_with(|| match identity::of_pid(h.pid, node) {
                Ok(w) => Some(w),
                Err(e) if gone(&e) => None,
                Err(_) => Some(Whose::Unknown),
            });
        let Some(w) = w else {
            return false;
        };
        h.alloc_id = w.alloc_id().map(str::to_string);
        h.other_node = *w == Whose::OtherNode;
        true
    };
    for usage in &mut usages {
        for list in [&mut usage.holders, &mut usage.copies] {
            list.retain_mut(&mut identify);
            list.sort();
            list.dedup();
        }
    }
    Ok(usages)
}

/// The allocations that have a process on this node: the task cgroups of this node's Nomad
/// client that hold a process (`crate::node::identity`: each process's cgroup names its
/// allocation, whatever its environment says). A process found in a task cgroup is
/// remembered by its pid and the inode number of its `/proc` directory (a pid used again is
/// a new directory), so a scan reads only the processes new since the last and those in no
/// task cgroup (which may have been moved into one since).
#[derive(Debug)]
pub struct AllocProcesses {
    node: NodeCgroups,
    seen: std::collections::HashMap<(u32, u64), String>,
}

impl AllocProcesses {
    /// The allocations of `node`'s task cgroups (the agent passes [`identity::node`]).
    pub fn new(node: NodeCgroups) -> Self {
        Self {
            node,
            seen: std::collections::HashMap::new(),
        }
    }

    /// Lists `/proc` and returns the allocation IDs of its processes. Blocking: call it
    /// from a blocking task. Errors: `/proc` cannot be listed.
    pub fn scan(&mut self) -> Result<BTreeSet<String>, HoldersError> {
        let listed = pids()?;
        let mut seen = std::collections::HashMap::with_capacity(listed.len());
        for (pid, ino) in listed {
            let alloc = match self.seen.remove(&(pid, ino)) {
                Some(known) if ino > 1 => Some(known),
                _ => identity::of_pid(pid, &self.node)
                    .ok()
                    .and_then(|w| w.alloc_id().map(str::to_string)),
            };
            if let Some(alloc) = alloc {
                seen.insert((pid, ino), alloc);
            }
        }
        self.seen = seen;
        Ok(self.seen.values().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::procfs::*;
    use super::*;
    use crate::node::mounts::scratch::Scratch;
    use std::process::{Child, Command, Stdio};

    #[test]
    fn proc_files_are_read_whole_and_names_that_are_not_utf8_do_not_fail_the_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("maps");
        let mut bytes = b"7f00-7f01 r--p 00000000 fe:00 42 /srv/\xff\xfe.so\n".to_vec();
        // Longer than one read's buffer, so the loop runs more than once.
        bytes.extend(std::iter::repeat_n(b'x', 10_000));
        std::fs::write(&p, &bytes).unwrap();
        let text = read_whole(std::fs::File::open(&p).unwrap()).unwrap();
        assert!(text.starts_with("7f00-7f01 r--p 00000000 fe:00 42 /srv/"));
        assert!(text.contains('\u{fffd}'), "{text:.60}");
        assert_eq!(
            text.len(),
            bytes.len() + 4,
            "two bytes became two 3-byte replacements"
        );
        // And a real /proc file, whose size the kernel shows as 0.
        let own = read_whole(std::fs::File::open("/proc/self/maps").unwrap()).unwrap();
        assert!(own.lines().count() > 5, "{own}");
    }

    /// A scratch cgroup v2 tree under the cgroup2 mount, for processes a test puts in task
    /// cgroups; on drop every process in it is killed and every cgroup removed.
    struct TestCgroups(PathBuf);

    impl TestCgroups {
        fn new() -> Self {
            let mount = crate::node::helpers::cgroup2_mount()
                .unwrap()
                .expect("no cgroup v2 filesystem is mounted (see /proc/self/mountinfo): these tests need one");
            let p = mount.join(format!("dhv-binder-unit-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir(&p).expect("make a scratch cgroup (the tests run as root)");
            Self(p)
        }

        /// The cgroup `rel` under the scratch cgroup, made.
        fn child(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(&p).unwrap();
            p
        }

        /// The scratch cgroup's path as `/proc/<pid>/cgroup` shows it, plus `rel`.
        fn rel(&self, rel: &str) -> String {
            let mount = crate::node::helpers::cgroup2_mount().unwrap().unwrap();
            let base = self.0.strip_prefix(&mount).unwrap().display().to_string();
            format!("{base}/{rel}")
        }
    }

    impl Drop for TestCgroups {
        fn drop(&mut self) {
            let _ = crate::node::helpers::kill(&self.0);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while crate::node::helpers::populated(&self.0).unwrap_or(false)
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let _ = crate::node::helpers::remove(&self.0);
        }
    }

    /// A shell that enters `cgroup` before it says ready.
    fn in_cgroup(cgroup: &Path, then: &str) -> Command {
        sh(&format!(
            "echo $$ > '{}' && echo ready && {then}",
            cgroup.join("cgroup.procs").display()
        ))
    }

    const A: &str = "0b9a3c2e-1111-4000-8000-00000000000a";
    const B: &str = "0b9a3c2e-1111-4000-8000-00000000000b";
    const LIE: &str = "0b9a3c2e-1111-4000-8000-0000000000ff";

    /// Holders are named by their cgroup: a task's process by its allocation, another
    /// node's as another node's, and a process that only claims an allocation in its
    /// environment (`NOMAD_ALLOC_ID`) as nobody's. The allocations with a process here are
    /// those of this node's task cgroups.
    #[test]
    fn holders_and_allocations_are_named_by_cgroup_not_environment() {
        let s = Scratch::new();
        let (target, id) = volume(&s);
        let cg = TestCgroups::new();
        let a = cg.child(&format!("n1.nomad/share.slice/{A}.app.scope"));
        let b = cg.child(&format!("n2.nomad/share.slice/{B}.app.scope"));
        let node = NodeCgroups {
            parent_v2: cg.rel("n1.nomad"),
            parent_v1: "nomad".into(),
            other_nodes: vec![cg.rel("n2.nomad")],
        };
        let task = Proc::spawn(in_cgroup(&a, "exec sleep 600").current_dir(&target)).ready();
        let theirs = Proc::spawn(in_cgroup(&b, "exec sleep 600").current_dir(&target)).ready();
        let liar = Proc::spawn(
            sh("echo ready; exec sleep 600")
                .current_dir(&target)
                .env("NOMAD_ALLOC_ID", LIE),
        )
        .ready();
        let host = MountTable::read().unwrap();
        let u = scan_many(&[(id, target.clone())], &host, &node)
            .unwrap()
            .pop()
            .unwrap();
        let of = |pid: u32| u.holders.iter().find(|h| h.pid == pid).cloned();
        let t = of(task.pid()).expect("the task holds it");
        assert_eq!(
            (t.alloc_id.as_deref(), t.other_node),
            (Some(A), false),
            "{t:?}"
        );
        let o = of(theirs.pid()).expect("the other node's task holds it");
        assert_eq!((o.alloc_id.as_deref(), o.other_node), (None, true), "{o:?}");
        let l = of(liar.pid()).expect("the liar holds it");
        assert_eq!(
            (l.alloc_id.as_deref(), l.other_node),
            (None, false),
            "{l:?}"
        );
        let mine = u.clone().without_other_nodes();
        let pids: BTreeSet<u32> = mine.holders.iter().map(|h| h.pid).collect();
        assert_eq!(pids, BTreeSet::from([task.pid(), liar.pid()]));

        let mut procs = AllocProcesses::new(node);
        let found = procs.scan().unwrap();
        assert!(found.contains(A), "{found:?}");
        assert!(!found.contains(B) && !found.contains(LIE), "{found:?}");
        assert!(procs.scan().unwrap().contains(A), "a remembered process");
        drop(task);
        assert!(!procs.scan().unwrap().contains(A), "a process that is gone");
    }

    #[test]
    fn kernel_threads_are_told_from_processes() {
        // kthreadd (pid 2) is a kernel thread on every Linux; this process is not.
        assert!(
            is_kernel_thread(2),
            "pid 2 (kthreadd) must read as a kernel thread: the tests run in the host's pid namespace, as the agent does"
        );
        assert!(!is_kernel_thread(std::process::id()));
        assert!(
            !is_kernel_thread(u32::MAX),
            "an unreadable stat is checked, not skipped"
        );
    }

    #[test]
    fn kernel_threads_are_remembered_by_pid_and_directory() {
        let me = std::process::id();
        let listed = pids().unwrap();
        let mine = listed.iter().find(|(p, _)| *p == me).map(|&(_, ino)| ino);
        let kthreadd = listed.iter().find(|(p, _)| *p == 2).map(|&(_, ino)| ino);
        let (Some(mine), Some(kthreadd)) = (mine, kthreadd) else {
            panic!("/proc lists neither this process nor kthreadd (pid 2): {listed:?}");
        };
        assert!(mine > 1 && kthreadd > 1, "procfs gave no inode numbers");
        let kept = without_kernel_threads(vec![(2, kthreadd), (me, mine)]);
        assert_eq!(kept, vec![me], "kthreadd is skipped, this process is not");
        assert_eq!(
            KERNEL_THREADS.lock().unwrap().get(&2),
            Some(&kthreadd),
            "kthreadd is remembered with its directory's inode"
        );
        // A pid remembered with another directory (used again since) is read again.
        KERNEL_THREADS.lock().unwrap().insert(me, mine + 1);
        assert_eq!(without_kernel_threads(vec![(me, mine)]), vec![me]);
        assert_eq!(
            KERNEL_THREADS.lock().unwrap().get(&me),
            None,
            "a stale entry is forgotten"
        );
    }

    /// A child process killed (and reaped) on drop, even when the test fails.
    struct Proc(Child);

    impl Proc {
        fn spawn(cmd: &mut Command) -> Self {
            Proc(cmd.stdout(Stdio::piped()).spawn().expect("spawn a holder"))
        }

        fn pid(&self) -> u32 {
            self.0.id()
        }

        /// Waits until the child printed its ready line (it holds the volume then).
        fn ready(mut self) -> Self {
            use std::io::BufRead;
            let out = self.0.stdout.take().expect("piped stdout");
            let mut line = String::new();
            std::io::BufReader::new(out)
                .read_line(&mut line)
                .expect("read the ready line");
            assert_eq!(line.trim(), "ready", "the holder did not start");
            self
        }

        /// Waits (up to 10 s) until the child has exec'd `program`: its ready line is printed
        /// by `sh` before the `exec`, so the program is not yet mapped when the line arrives.
        fn running(self, program: &Path) -> Self {
            let exe = PathBuf::from(format!("/proc/{}/exe", self.pid()));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::fs::read_link(&exe).ok().as_deref() != Some(program) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "pid {} did not exec {} within 10 s",
                    self.pid(),
                    program.display()
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            self
        }
    }

    impl Drop for Proc {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    fn volume(s: &Scratch) -> (PathBuf, MountIdentity) {
        let target = s.tmpfs("mnt/default/v1");
        std::fs::write(target.join("f"), "x").unwrap();
        let id = MountTable::read()
            .unwrap()
            .top_at(&target)
            .unwrap()
            .identity();
        (target, id)
    }

    fn scan_now(id: &MountIdentity, target: &Path) -> Usage {
        scan(id, target, &MountTable::read().unwrap()).unwrap()
    }

    #[test]
    fn before_unpublish_reads_the_target_now() {
        let s = Scratch::new();
        let (target, _) = volume(&s);
        let idle = before_unpublish(&target).unwrap().expect("mounted");
        assert!(!idle.in_use(), "{}", idle.summary(5));
        let cwd = Proc::spawn(sh("echo ready; exec sleep 600").current_dir(&target)).ready();
        let busy = before_unpublish(&target).unwrap().expect("mounted");
        assert!(
            busy.summary(5).contains(&format!("pid {}", cwd.pid())),
            "{busy:?}"
        );
        drop(cwd);
        nix::mount::umount(&target).unwrap();
        assert_eq!(before_unpublish(&target).unwrap(), None);
    }

    #[test]
    fn an_idle_volume_has_no_holders() {
        let s = Scratch::new();
        let (target, id) = volume(&s);
        let started = std::time::Instant::now();
        let u = scan_now(&id, &target);
        eprintln!(
            "scan of {} processes took {:?}",
            pids().unwrap().len(),
            started.elapsed()
        );
        assert!(u.holders.is_empty(), "{}", u.summary(5));
        assert!(u.other_mounts.is_empty());
        assert!(!u.in_use(), "{u:?}");
        assert!(
            u.by_kernel,
            "the kernel answers for a volume with one mount"
        );
    }

    #[test]
    fn open_file_cwd_and_mapping_are_found() {
        let s = Scratch::new();
        let (target, id) = volume(&s);
        let f = target.join("f");
        let open = Proc::spawn(
            sh(&format!(
                "exec 3<'{}'; echo ready; exec sleep 600",
                f.display()
            ))
            .env("NOMAD_ALLOC_ID", "a1"),
        )
        .ready();
        let cwd = Proc::spawn(sh("echo ready; exec sleep 600").current_dir(&target)).ready();
        let u = scan_now(&id, &target);
        assert!(u.in_use());
        assert!(!u.by_kernel, "a busy mount is scanned to name its holders");
        let hows: Vec<(u32, &Hold)> = u.holders.iter().map(|h| (h.pid, &h.how)).collect();
        assert!(
            hows.iter().any(|(p, h)| *p == open.pid()
                && matches!(h, Hold::OpenFile { fd: 3, path } if path == &f)),
            "{hows:?}"
        );
        assert!(
            hows.iter()
                .any(|(p, h)| *p == cwd.pid() && **h == Hold::Cwd),
            "{hows:?}"
        );
        // `sh` until it has exec'd `sleep`: either way the process is named.
        assert!(
            u.holders
                .iter()
                .all(|h| ["sh", "sleep"].contains(&h.comm.as_str())),
            "{:?}",
            u.holders
        );
        // Its environment names an allocation; its cgroup (the host's) names none.
        assert!(u
            .holders
            .iter()
            .any(|h| h.pid == open.pid() && h.alloc_id.is_none() && !h.other_node));
        drop((open, cwd));
        let u = scan_now(&id, &target);
        assert!(!u.in_use() && u.by_kernel, "{u:?}");

        // A program running from the volume (its text mapped and its exe on it).
        std::fs::copy("/bin/sleep", target.join("sleep")).unwrap();
        let prog = Proc::spawn(&mut sh(&format!(
            "echo ready; exec '{}' 600",
            target.join("sleep").display()
        )))
        .ready()
        .running(&target.join("sleep"));
        let u = scan_now(&id, &target);
        let mine: Vec<&Hold> = u
            .holders
            .iter()
            .filter(|h| h.pid == prog.pid())
            .map(|h| &h.how)
            .collect();
        assert!(mine.contains(&&Hold::Exe), "{mine:?}");
        assert!(
            mine.iter().any(|h| matches!(h, Hold::Mapped { .. })),
            "{mine:?}"
        );
    }

    /// A task's mount namespace with the volume bound in holds it although no file is open:
    /// the host's unmount would succeed and leave the filesystem alive there.
    #[test]
    fn a_mount_in_another_namespace_is_found() {
        let s = Scratch::new();
        let (target, id) = volume(&s);
        let inner = s.dir("task/data");
        let task = in_namespace(
            &s,
            "private",
            &format!(
                "mount --rbind '{}' '{}' && cd / && echo ready && exec sleep 600",
                target.display(),
                inner.display()
            ),
        );
        let u = scan_now(&id, &target);
        assert!(u.in_use());
        assert!(
            !u.by_kernel,
            "a copy in another namespace has a count of its own"
        );
        assert!(
            u.holders.iter().any(|h| h.pid == task.pid()
                && matches!(&h.how, Hold::Mount { mount_point } if mount_point == &inner)),
            "{}",
            u.summary(5)
        );
        // The unshare'd namespace also carries a copy of the target itself.
        assert!(u.summary(5).contains(&format!("pid {}", task.pid())));
        drop(task);
        assert!(!scan_now(&id, &target).in_use());
    }

    /// A process started by `unshare --mount --propagation <propagation>` running `script`
    /// (which prints `ready` once it holds what it should). A private or slave namespace
    /// first drops its copies of the mounts of other tests than the one whose scratch
    /// directory is `s` ([`Scratch::drop_foreign_mounts`]); a peer namespace
    /// (`unchanged`) does not, since its unmounts would reach the host's mounts.
    fn in_namespace(s: &Scratch, propagation: &str, script: &str) -> Proc {
        let drop = match propagation {
            "private" | "slave" => s.drop_foreign_mounts(),
            _ => String::new(),
        };
        Proc::spawn(
            Command::new("unshare")
                .args(["--mount", "--propagation", propagation, "sh", "-c"])
                .arg(format!("{drop}{script}")),
        )
        .ready()
    }

    /// A namespace made after the publish with slave propagation (systemd makes one so for
    /// a service with `PrivateTmp=` or `ProtectSystem=`), or with the host's propagation
    /// unchanged, holds a copy of the target that the host's unmount takes along: reported,
    /// not a holder, and the kernel's unmount does remove it (the fact the scan relies on).
    /// A private copy, a copy with a mount on it, and a copy in use stay holders, and the
    /// unmount fails with EBUSY while a process works in a copy.
    #[test]
    fn a_copy_the_unmount_takes_along_is_no_holder() {
        let s = Scratch::new();
        // The placeholder guard: a shared mount; the volume mounted on it is shared too.
        let guard = s.tmpfs("mnt");
        nix::mount::mount(
            None::<&str>,
            &guard,
            None::<&str>,
            nix::mount::MsFlags::MS_SHARED,
            None::<&str>,
        )
        .expect("make the guard shared");
        let target = s.tmpfs("mnt/v1");
        std::fs::create_dir(target.join("sub")).unwrap();
        let host = MountTable::read().unwrap();
        let top = host.top_at(&target).unwrap();
        assert!(top.shared.is_some(), "{top:?}");
        let id = top.identity();

        let idle = "cd / && echo ready && exec sleep 600";
        let slave = in_namespace(&s, "slave", idle);
        let peer = in_namespace(&s, "unchanged", idle);
        let u = scan_now(&id, &target);
        assert!(!u.in_use(), "{}", u.summary(5));
        for p in [&slave, &peer] {
            assert!(
                u.copies.iter().any(|h| h.pid == p.pid()),
                "pid {} not among the copies: {:?}",
                p.pid(),
                u.copies
            );
        }
        assert!(
            !u.by_kernel,
            "copies are read, not left to the kernel's count"
        );

        // A private copy pins the filesystem: the host's unmount would not reach it.
        let private = in_namespace(&s, "private", idle);
        let u = scan_now(&id, &target);
        assert!(u.in_use());
        assert!(
            u.holders.iter().any(|h| h.pid == private.pid()),
            "{}",
            u.summary(5)
        );
        drop(private);

        // A copy with a mount on it in its own namespace is not taken along.
        let covered = in_namespace(
            &s,
            "slave",
            &format!(
                "mount -t tmpfs cover '{}/sub' && cd / && echo ready && exec sleep 600",
                target.display()
            ),
        );
        let u = scan_now(&id, &target);
        assert!(
            u.holders.iter().any(|h| h.pid == covered.pid()),
            "{}",
            u.summary(5)
        );
        drop(covered);

        // A slave copy under a parent that no longer receives the guard's propagation: the
        // unmount does not reach it (checked below, after the unmount).
        let cut_off = in_namespace(
            &s,
            "slave",
            &format!(
                "mount --make-private '{}' && cd / && echo ready && exec sleep 600",
                guard.display()
            ),
        );
        let u = scan_now(&id, &target);
        assert!(
            u.holders.iter().any(|h| h.pid == cut_off.pid()),
            "{}",
            u.summary(5)
        );

        // A process working in a copy holds it, and the kernel refuses the unmount.
        let user = in_namespace(
            &s,
            "slave",
            &format!("cd '{}' && echo ready && exec sleep 600", target.display()),
        );
        let u = scan_now(&id, &target);
        assert!(
            u.holders
                .iter()
                .any(|h| h.pid == user.pid() && h.how == Hold::Cwd),
            "{}",
            u.summary(5)
        );
        assert_eq!(
            nix::mount::umount(&target),
            Err(nix::errno::Errno::EBUSY),
            "the unmount reaches a copy in use"
        );
        drop(user);

        // The host's unmount removes the copies the scan did not count.
        nix::mount::umount(&target).expect("the host's unmount, with idle copies");
        for p in [&slave, &peer] {
            let left = MountTable::read_pid(p.pid()).unwrap();
            assert!(
                !left.entries().iter().any(|e| e.shows(&id)),
                "pid {}'s copy outlived the unmount",
                p.pid()
            );
        }
        let kept = MountTable::read_pid(cut_off.pid()).unwrap();
        assert!(
            kept.entries().iter().any(|e| e.shows(&id)),
            "the copy under a private parent is kept by the kernel (so it is a holder)"
        );
    }

    /// One pass for several volumes gives each volume exactly what its own scan gives.
    #[test]
    fn one_scan_of_several_volumes_equals_their_own_scans() {
        let s = Scratch::new();
        let a = s.tmpfs("mnt/default/a");
        let b = s.tmpfs("mnt/default/b");
        let idle = s.tmpfs("mnt/default/idle");
        let id = |t: &Path| MountTable::read().unwrap().top_at(t).unwrap().identity();
        let (ia, ib, ii) = (id(&a), id(&b), id(&idle));
        std::fs::write(a.join("f"), "x").unwrap();
        let open = Proc::spawn(&mut sh(&format!(
            "exec 3<'{}'; echo ready; exec sleep 600",
            a.join("f").display()
        )))
        .ready();
        let cwd = Proc::spawn(sh("echo ready; exec sleep 600").current_dir(&b)).ready();
        let host = MountTable::read().unwrap();
        let many = scan_many(
            &[
                (ia.clone(), a.clone()),
                (ib.clone(), b.clone()),
                (ii.clone(), idle.clone()),
            ],
            &host,
            identity::node(),
        )
        .unwrap();
        assert_eq!(many.len(), 3);
        assert!(
            many[0].holders.iter().any(|h| h.pid == open.pid()),
            "{many:?}"
        );
        assert!(
            many[0].holders.iter().all(|h| h.pid != cwd.pid()),
            "{many:?}"
        );
        assert!(
            many[1].holders.iter().any(|h| h.pid == cwd.pid()),
            "{many:?}"
        );
        assert!(
            many[1].holders.iter().all(|h| h.pid != open.pid()),
            "{many:?}"
        );
        assert!(!many[2].in_use(), "{:?}", many[2]);
        // The same holders and mounts (a holder's name may change between two scans: `sh`
        // becomes `sleep` at its exec).
        let shape = |u: &Usage| {
            (
                u.holders
                    .iter()
                    .map(|h| (h.pid, h.how.clone()))
                    .collect::<Vec<_>>(),
                u.other_mounts.clone(),
                u.uninspected
                    .iter()
                    .map(|x| (x.pid, x.what))
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(shape(&many[0]), shape(&scan(&ia, &a, &host).unwrap()));
        assert_eq!(shape(&many[1]), shape(&scan(&ib, &b, &host).unwrap()));
        assert_eq!(shape(&many[2]), shape(&scan(&ii, &idle, &host).unwrap()));
        // Targets with nothing mounted are None, in their place.
        let by_target =
            before_unpublish_many(&[a.clone(), s.path().join("nothing"), b.clone()]).unwrap();
        assert!(by_target[0].as_ref().is_some_and(Usage::in_use));
        assert!(by_target[1].is_none());
        assert!(by_target[2].as_ref().is_some_and(Usage::in_use));
    }

    /// A multi-threaded runtime with two workers, as the agent runs (the shared scan runs
    /// on the calling worker there).
    fn agent_like_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A call that announced a scan and is dropped before running it (its task aborted)
    /// leaves the scan to a blocking thread: a call that joined it is still answered.
    #[test]
    fn a_call_dropped_before_its_scan_leaves_the_scan_to_another_thread() {
        let s = Scratch::new();
        let (t1, t2) = (s.tmpfs("mnt/default/d1"), s.tmpfs("mnt/default/d2"));
        let rt = agent_like_runtime();
        let answer = rt.block_on(async {
            use std::future::Future;
            let mut first = Box::pin(before_unpublish_shared(t1));
            let mut joined = Box::pin(before_unpublish_shared(t2.clone()));
            std::future::poll_fn(|cx| {
                assert!(
                    first.as_mut().poll(cx).is_pending(),
                    "yields before it scans"
                );
                let _ = joined.as_mut().poll(cx);
                std::task::Poll::Ready(())
            })
            .await;
            drop(first);
            tokio::time::timeout(std::time::Duration::from_secs(20), joined).await
        });
        let usage = answer
            .expect("the joined call is answered")
            .unwrap()
            .expect("mounted");
        assert!(!usage.in_use(), "{usage:?}");
    }

    /// Unpublishes that wait at the same time share scans: 8 at once cost a few passes
    /// over /proc (a scan takes the calls made before it begins), and each still gets its
    /// own volume's answer.
    #[test]
    fn unpublishes_waiting_together_share_one_scan() {
        let s = Scratch::new();
        let targets: Vec<PathBuf> = (0..8)
            .map(|i| s.tmpfs(&format!("mnt/default/v{i}")))
            .collect();
        let busy = Proc::spawn(sh("echo ready; exec sleep 600").current_dir(&targets[3])).ready();
        let rt = agent_like_runtime();
        let answers = rt.block_on(async {
            let calls = targets.iter().map(|t| before_unpublish_shared(t.clone()));
            futures_util::future::join_all(calls).await
        });
        let scans = BATCHES
            .lock()
            .unwrap()
            .iter()
            .filter(|b| b.iter().any(|t| targets.contains(t)))
            .count();
        assert!((1..=3).contains(&scans), "{scans} scans for 8 calls");
        for (i, a) in answers.into_iter().enumerate() {
            let usage = a.unwrap().expect("mounted");
            assert_eq!(usage.in_use(), i == 3, "v{i}: {usage:?}");
            if i == 3 {
                assert!(usage.holders.iter().any(|h| h.pid == busy.pid()));
            }
        }
    }

    #[test]
    fn another_mount_in_the_host_namespace_is_found() {
        let s = Scratch::new();
        let (target, id) = volume(&s);
        let other = s.path().join("elsewhere");
        s.rbind(&target, &other);
        let u = scan_now(&id, &target);
        assert_eq!(u.other_mounts, vec![other.clone()]);
        assert!(!u.in_use(), "a mount is no process");
        assert!(
            !u.by_kernel,
            "another mount of it is scanned, not asked of the kernel"
        );
        assert!(u.summary(5).contains("also mounted at"));
        // A process using the volume through the other mount holds it.
        let cwd = Proc::spawn(sh("echo ready; exec sleep 600").current_dir(&other)).ready();
        let u = scan_now(&id, &target);
        assert!(
            u.holders.iter().any(|h| h.pid == cwd.pid()),
            "{:?}",
            u.holders
        );
    }

    /// The same disk bound elsewhere from another directory is not the volume.
    #[test]
    fn other_directories_of_the_same_device_are_not_the_volume() {
        let s = Scratch::new();
        let disk = s.tmpfs("disk");
        std::fs::create_dir_all(disk.join("vol")).unwrap();
        std::fs::create_dir_all(disk.join("other")).unwrap();
        let target = s.path().join("mnt/v");
        s.rbind(&disk.join("vol"), &target);
        let host = MountTable::read().unwrap();
        let id = host.top_at(&target).unwrap().identity();
        let busy =
            Proc::spawn(sh("echo ready; exec sleep 600").current_dir(disk.join("other"))).ready();
        let u = scan(&id, &target, &host).unwrap();
        assert!(
            u.holders.iter().all(|h| h.pid != busy.pid()),
            "{:?}",
            u.holders
        );
        let cwd = Proc::spawn(sh("echo ready; exec sleep 600").current_dir(&target)).ready();
        let u = scan_now(&id, &target);
        assert!(
            u.holders.iter().any(|h| h.pid == cwd.pid()),
            "{:?}",
            u.holders
        );
    }
}
