//! Helper cgroups: where plugins' long-lived helpers run (a FUSE server such as the `webdav`
//! plugin's `rclone mount`), outside the daemon's own cgroup.
//!
//! Nomad runs a `raw_exec` task and every process it starts, `setsid` or not, in the task's
//! cgroup, and kills that whole cgroup when the task stops (`drivers/rawexec`,
//! `drivers/shared/executor`, `client/lib/cgroupslib`; cgroups v2 since Nomad 1.7). A helper
//! left in the daemon's cgroup would die with the daemon on every upgrade, drain or OOM kill,
//! and take its mount with it. So every published volume gets a cgroup of its own, under a
//! parent dhv-binder owns (default `<cgroup2 mount>/dhv-binder.slice`, as Nomad keeps its
//! tasks under `nomad.slice`), named after the volume
//! (`<namespace>.<name>.<volume id>.scope`), with its own memory limit (`memory.max`) when
//! the kernel offers the memory controller there. A plugin moves its helper into it
//! (`DHV_HELPER_CGROUP`, docs/plugin-protocol.md); the agent adopts the cgroups it finds at
//! start, and on unpublish waits until the volume's cgroup is empty before it removes it.

use crate::config::HelperCgroupSetting;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The parent's name under the cgroup2 mount when none is configured.
pub const DEFAULT_PARENT: &str = "dhv-binder.slice";
/// The suffix of every helper cgroup's name.
const SUFFIX: &str = ".scope";

/// What can go wrong with helper cgroups; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    #[error("{path} is not on a cgroup v2 filesystem: give --helper-cgroup a directory under the cgroup2 mount (see /proc/self/mountinfo), or `none`")]
    NotCgroup2 { path: PathBuf },
    #[error("cgroup {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the helper of volume {volume} still runs in {cgroup} ({pids} processes) {waited:?} after its unpublish: it may still be writing its data out; unpublish is retried")]
    StillRunning {
        volume: String,
        cgroup: PathBuf,
        pids: usize,
        waited: Duration,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> HelperError + '_ {
    move |source| HelperError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The mount point of the cgroup v2 hierarchy, from `/proc/self/mountinfo` (`/sys/fs/cgroup`
/// on a unified host, `/sys/fs/cgroup/unified` on a hybrid one); `None` without one.
pub fn cgroup2_mount() -> io::Result<Option<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(cgroup2_mount_in(&text))
}

/// [`cgroup2_mount`] of a mountinfo text.
pub fn cgroup2_mount_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        let mount_point = left.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_octal(mount_point)))
    })
}

fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup v2 path of process `pid` (`0::<path>` in `/proc/<pid>/cgroup`), relative to
/// the cgroup2 mount, `None` when it has none.
pub fn cgroup_of(pid: u32) -> io::Result<Option<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string))
}

/// True when `path` is on a cgroup v2 filesystem.
pub fn is_cgroup2(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

/// True while the cgroup or one of its descendants holds a process (`populated 1` in
/// `cgroup.events`). A cgroup that does not exist is empty.
pub fn populated(cgroup: &Path) -> io::Result<bool> {
    match std::fs::read_to_string(cgroup.join("cgroup.events")) {
        Ok(t) => Ok(t.lines().any(|l| l.trim() == "populated 1")),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The processes in the cgroup and its descendants.
pub fn pids(cgroup: &Path) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for child in children(cgroup) {
        out.extend(pids(&child));
    }
    out
}

fn children(cgroup: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cgroup)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Kills every process of the cgroup and its descendants (`cgroup.kill`, Linux 5.14), as
/// Nomad's executor does when a task stops.
pub fn kill(cgroup: &Path) -> io::Result<()> {
    std::fs::write(cgroup.join("cgroup.kill"), "1")
}

/// Moves process `pid` (0: the writer itself) into `cgroup`.
pub fn enter(cgroup: &Path, pid: u32) -> io::Result<()> {
    std::fs::write(cgroup.join("cgroup.procs"), pid.to_string())
}

/// Removes an empty cgroup and its (empty) descendants, deepest first; a missing one is
/// fine. Fails (EBUSY) while a process is in it: nothing is killed here.
pub fn remove(cgroup: &Path) -> io::Result<()> {
    for child in children(cgroup) {
        remove(&child)?;
    }
    match std::fs::remove_dir(cgroup) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The node's helper cgroups as configured (`--helper-cgroup`, `--helper-memory-max`):
/// `None` when turned off or, with `auto`, when no cgroup v2 filesystem is mounted (both
/// logged as warnings: helpers then share the agent's cgroup and die with it).
pub fn from_settings(
    setting: &HelperCgroupSetting,
    memory_max: Option<u64>,
) -> Result<Option<HelperCgroups>, HelperError> {
    let parent = match setting {
        HelperCgroupSetting::None => {
            tracing::warn!("--helper-cgroup none: plugin helpers (FUSE servers) share the agent's cgroup; under Nomad they die with the agent's task on every upgrade, drain or restart, and their mounts with them");
            return Ok(None);
        }
        HelperCgroupSetting::Auto => match cgroup2_mount() {
            Ok(Some(m)) => m.join(DEFAULT_PARENT),
            found => {
                let why = match found {
                    Err(e) => format!("cannot read /proc/self/mountinfo: {e}"),
                    _ => "no cgroup v2 filesystem is mounted".into(),
                };
                tracing::warn!(reason = %why, "no helper cgroups: plugin helpers (FUSE servers) share the agent's cgroup and die with it");
                return Ok(None);
            }
        },
        HelperCgroupSetting::Under(p) => p.clone(),
    };
    let h = HelperCgroups::open(&parent, memory_max)?;
    match (memory_max, h.memory_limited()) {
        (Some(_), false) => {
            tracing::warn!(parent = %parent.display(), "the memory controller is not available under the helper cgroups' parent: helpers run without memory.max (enable it in the parent's cgroup.subtree_control)")
        }
        _ => {
            tracing::info!(parent = %parent.display(), memory_max = ?memory_max, "plugin helpers run in per-volume cgroups")
        }
    }
    Ok(Some(h))
}

/// One helper cgroup found under the parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    /// The volume ID its name ends with.
    pub volume_id: String,
    pub pids: Vec<i32>,
}

/// The node's helper cgroups: the parent and the memory limit of each.
#[derive(Debug, Clone)]
pub struct HelperCgroups {
    parent: PathBuf,
    /// `memory.max` of each helper cgroup, in bytes; `None`: no limit.
    memory_max: Option<u64>,
    /// False when the memory controller is not available under the parent.
    memory: bool,
}

impl HelperCgroups {
    /// Makes `parent` (a directory on the cgroup2 filesystem, created if missing) the home of
    /// the helper cgroups, and enables the memory controller for its children when the
    /// kernel offers it there (`cgroup.controllers`); else each cgroup runs without
    /// `memory.max` ([`HelperCgroups::memory_limited`] says so).
    pub fn open(parent: &Path, memory_max: Option<u64>) -> Result<Self, HelperError> {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        if !is_cgroup2(parent) {
            return Err(HelperError::NotCgroup2 {
                path: parent.to_path_buf(),
            });
        }
        Ok(Self::on(parent, memory_max))
    }

    /// [`HelperCgroups::open`] without the filesystem check (unit tests on a plain directory).
    pub fn on(parent: &Path, memory_max: Option<u64>) -> Self {
        let offered = std::fs::read_to_string(parent.join("cgroup.controllers"))
            .unwrap_or_default()
            .split_whitespace()
            .any(|c| c == "memory");
        let memory = offered
            && memory_max.is_some()
            && (std::fs::read_to_string(parent.join("cgroup.subtree_control"))
                .unwrap_or_default()
                .split_whitespace()
                .any(|c| c == "memory")
                || std::fs::write(parent.join("cgroup.subtree_control"), "+memory").is_ok());
        HelperCgroups {
            parent: parent.to_path_buf(),
            memory_max,
            memory,
        }
    }

    /// The parent directory.
    pub fn parent(&self) -> &Path {
        &self.parent
    }

    /// True when each helper cgroup gets `memory.max`.
    pub fn memory_limited(&self) -> bool {
        self.memory
    }

    /// The cgroup of a volume's helpers: `<parent>/<namespace>.<name>.<volume id>.scope`.
    pub fn path_of(&self, namespace: &str, name: &str, volume_id: &str) -> PathBuf {
        self.parent
            .join(format!("{namespace}.{name}.{volume_id}{SUFFIX}"))
    }

    /// Makes the volume's cgroup (kept if it exists) with its memory limit; returns its path.
    pub fn prepare(
        &self,
        namespace: &str,
        name: &str,
        volume_id: &str,
    ) -> Result<PathBuf, HelperError> {
        let path = self.path_of(namespace, name, volume_id);
        self.make(&path)?;
        Ok(path)
    }

    /// Makes the cgroup `path` (one of [`HelperCgroups::path_of`]; kept if it exists) and
    /// sets its memory limit.
    pub fn make(&self, path: &Path) -> Result<(), HelperError> {
        match std::fs::create_dir(path) {
            Err(e) if e.kind() != ErrorKind::AlreadyExists => return Err(io_err(path)(e)),
            _ => {}
        }
        if let (true, Some(max)) = (self.memory, self.memory_max) {
            let file = path.join("memory.max");
            std::fs::write(&file, max.to_string()).map_err(io_err(&file))?;
        }
        Ok(())
    }

    /// Every helper cgroup under the parent, with the volume ID its name ends with.
    pub fn list(&self) -> Vec<Found> {
        let mut out: Vec<Found> = children(&self.parent)
            .into_iter()
            .filter_map(|path| {
                let name = path.file_name()?.to_str()?.strip_suffix(SUFFIX)?;
                let (_, id) = name.rsplit_once('.')?;
                Some(Found {
                    volume_id: id.to_string(),
                    pids: pids(&path),
                    path,
                })
            })
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// At the agent's start: keeps the cgroups of volumes the journal holds (their helpers
    /// serve published volumes: adopted as they are), removes empty ones of no volume, and
    /// leaves a populated one of no volume alone (logged: nothing is killed on a guess).
    /// Returns the adopted cgroups.
    pub fn adopt(&self, journal_volume_ids: &[String]) -> Vec<Found> {
        let mut adopted = Vec::new();
        for f in self.list() {
            if journal_volume_ids.contains(&f.volume_id) {
                tracing::info!(cgroup = %f.path.display(), volume_id = %f.volume_id, processes = f.pids.len(), "adopted the helper cgroup of a published volume");
                adopted.push(f);
            } else if f.pids.is_empty() {
                if let Err(e) = remove(&f.path) {
                    tracing::warn!(cgroup = %f.path.display(), error = %e, "cannot remove an empty helper cgroup");
                }
            } else {
                tracing::warn!(cgroup = %f.path.display(), volume_id = %f.volume_id, processes = f.pids.len(), "a helper cgroup holds processes but no volume of the journal: left alone (kill them with `echo 1 > <cgroup>/cgroup.kill` once you know they serve nothing)");
            }
        }
        adopted
    }
}

/// After a successful unpublish of `volume`: waits up to `timeout` for the helpers in
/// `cgroup` to exit (a FUSE server writes its cache out after the unmount), then removes the
/// cgroup. A cgroup that does not exist is done.
pub async fn finish(volume: &str, cgroup: &Path, timeout: Duration) -> Result<(), HelperError> {
    let started = Instant::now();
    while populated(cgroup).map_err(io_err(cgroup))? {
        if started.elapsed() >= timeout {
            return Err(HelperError::StillRunning {
                volume: volume.to_string(),
                pids: pids(cgroup).len(),
                cgroup: cgroup.to_path_buf(),
                waited: timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    remove(cgroup).map_err(io_err(cgroup))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_read_from_mountinfo() {
        let hybrid = "30 24 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
            41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_in(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified =
            "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            cgroup2_mount_in(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        let spaced = "35 24 0:30 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount_in(spaced), Some(PathBuf::from("/mnt/cg two")));
        assert_eq!(
            cgroup2_mount_in("30 24 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"),
            None
        );
    }

    /// On a plain directory standing for a cgroup: a volume's cgroup is named after it, gets
    /// `memory.max` when the parent offers the memory controller (and enables it for its
    /// children), and none when it does not.
    #[test]
    fn a_volume_cgroup_is_named_after_it_and_limited_when_the_kernel_offers_memory() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("dhv-binder.slice");
        std::fs::create_dir(&parent).unwrap();
        std::fs::write(parent.join("cgroup.controllers"), "cpu io memory pids\n").unwrap();
        std::fs::write(parent.join("cgroup.subtree_control"), "").unwrap();
        let h = HelperCgroups::on(&parent, Some(256 << 20));
        assert!(h.memory_limited());
        assert_eq!(
            std::fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap(),
            "+memory"
        );
        let id = "7c1e0c52-2a4f-4b8e-9d1a-0f4f6e0b8a11";
        let p = h.prepare("default", "shared-data", id).unwrap();
        assert_eq!(p, parent.join(format!("default.shared-data.{id}.scope")));
        assert_eq!(
            std::fs::read_to_string(p.join("memory.max")).unwrap(),
            "268435456"
        );
        // Again: kept as it is.
        assert_eq!(h.prepare("default", "shared-data", id).unwrap(), p);
        let found = h.list();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].volume_id, id);

        let bare = dir.path().join("no-memory");
        std::fs::create_dir(&bare).unwrap();
        std::fs::write(bare.join("cgroup.controllers"), "cpu pids\n").unwrap();
        let h = HelperCgroups::on(&bare, Some(256 << 20));
        assert!(!h.memory_limited());
        let p = h.prepare("default", "v", id).unwrap();
        assert!(!p.join("memory.max").exists());
    }

    /// At start, the cgroup of a journalled volume is adopted, an empty one of no volume is
    /// removed, and a populated one of no volume is left alone.
    #[test]
    fn adoption_keeps_journalled_volumes_and_removes_only_empty_strangers() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("helpers");
        std::fs::create_dir(&parent).unwrap();
        let h = HelperCgroups::on(&parent, None);
        let ours = h.prepare("default", "a", "id-a").unwrap();
        let empty = h.prepare("default", "b", "id-b").unwrap();
        let busy = h.prepare("default", "c", "id-c").unwrap();
        std::fs::write(busy.join("cgroup.procs"), "4242\n").unwrap();
        std::fs::write(busy.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        let adopted = h.adopt(&["id-a".to_string()]);
        assert_eq!(adopted.len(), 1);
        assert_eq!(adopted[0].path, ours);
        assert!(ours.exists());
        assert!(!empty.exists());
        assert!(busy.exists());
    }
}
