//! Per-task cgroups (cgroups v2) of the `raw_exec` and `exec` drivers.
//!
//! Nomad runs each task, and every process it starts (`setsid` or not), in a cgroup of its own,
//! `<cgroup root>/<cgroup_parent>/share.slice/<alloc id>.<task>.scope` (`client/lib/cgroupslib`:
//! `editor.go` `pathCG2`/`scopeCG2`, `partition.go` `SharePartition`; the client's
//! `cgroup_parent`, default `nomad.slice`, `init.go` `CustomPathCG2`). The executor writes
//! the task's memory limits there before the task starts (`drivers/shared/executor`
//! `executor_universal_linux.go` `configureCG2`, limits from `utils.go` `memoryLimits`) and
//! starts the task inside it (`UseCgroupFD`). When the task runner stops, the wrangler hook
//! kills whatever is left in it and removes it (`client/allocrunner/taskrunner/wrangler_hook.go`
//! `Stop` → `client/lib/proclib/wrangler.go` `Destroy` → `wrangler_cg2_linux.go` `Kill`:
//! `cgroup.kill`, then `Cleanup`).
//!
//! Unlike Nomad, the simulator has no default parent: a client gets per-task cgroups only
//! with `cgroup_parent` in its config block, so that it never touches the host's own
//! `nomad.slice` (tests give it a directory under their scratch cgroup). It models cgroups v2
//! only (Nomad uses v1 where `/sys/fs/cgroup` is a tmpfs: `mount.go` `scan`).

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The tasks' cgroups of one client: `<parent>/share.slice/<alloc id>.<task>.scope`.
#[derive(Debug, Clone)]
pub struct TaskCgroups {
    share: PathBuf,
    memory: bool,
}

/// A task's memory limits in bytes, as Nomad's executor writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    /// `memory.max`; `None`: `max` (no hard limit, `memory_max = -1`).
    pub max: Option<u64>,
    /// `memory.low`, when `memory_max` is set (then `memory` is the reservation).
    pub low: Option<u64>,
}

/// Nomad's `memoryLimits` (`drivers/shared/executor/utils.go`): `memory` (MiB) is the hard
/// limit; with `memory_max` set (> 0) that is the hard limit and `memory` becomes
/// `memory.low`; `memory_max = -1` means no hard limit. The simulator passes `memory_max` on
/// as Nomad does with memory oversubscription enabled.
pub fn memory_limits(memory_mb: i64, memory_max_mb: i64) -> MemoryLimits {
    let mib = |m: i64| (m.max(0) as u64) * 1024 * 1024;
    match memory_max_mb {
        -1 => MemoryLimits {
            max: None,
            low: Some(mib(memory_mb)),
        },
        m if m > 0 => MemoryLimits {
            max: Some(mib(m)),
            low: Some(mib(memory_mb)),
        },
        _ => MemoryLimits {
            max: Some(mib(memory_mb)),
            low: None,
        },
    }
}

fn ctx(path: &Path, what: &str) -> impl FnOnce(io::Error) -> io::Error {
    let p = path.display().to_string();
    let what = what.to_string();
    move |e| io::Error::new(e.kind(), format!("{what} {p}: {e}"))
}

impl TaskCgroups {
    /// Makes `<parent>` and `<parent>/share.slice` and enables the memory controller in both
    /// `cgroup.subtree_control` where the kernel offers it (`cgroupslib.Init`). `parent` must
    /// be a directory on a cgroup v2 filesystem (or one to make there).
    pub fn open(parent: &Path) -> io::Result<Self> {
        let share = parent.join("share.slice");
        std::fs::create_dir_all(&share).map_err(ctx(&share, "make the cgroup"))?;
        if !share.join("cgroup.procs").exists() {
            return Err(io::Error::other(format!(
                "{} is not on a cgroup v2 filesystem (cgroup_parent must name a directory under the cgroup2 mount)",
                parent.display()
            )));
        }
        for dir in [parent, share.as_path()] {
            let offered = std::fs::read_to_string(dir.join("cgroup.controllers"))
                .unwrap_or_default()
                .split_whitespace()
                .any(|c| c == "memory");
            if offered {
                let _ = std::fs::write(dir.join("cgroup.subtree_control"), "+memory");
            }
        }
        let memory = std::fs::read_to_string(share.join("cgroup.subtree_control"))
            .unwrap_or_default()
            .split_whitespace()
            .any(|c| c == "memory");
        Ok(TaskCgroups { share, memory })
    }

    /// True when the tasks' cgroups get `memory.max` (the memory controller is enabled in
    /// `share.slice`); otherwise the tasks run without a memory limit.
    pub fn memory_limited(&self) -> bool {
        self.memory
    }

    /// The cgroup of task `task` of allocation `alloc_id` (`scopeCG2`).
    pub fn path(&self, alloc_id: &str, task: &str) -> PathBuf {
        self.share.join(format!("{alloc_id}.{task}.scope"))
    }

    /// Makes the task's cgroup (kept if it exists: a restarted task reuses it) and writes
    /// its memory limits where the controller is enabled (`configureCG2`).
    pub fn setup(&self, alloc_id: &str, task: &str, limits: MemoryLimits) -> io::Result<PathBuf> {
        let path = self.path(alloc_id, task);
        std::fs::create_dir_all(&path).map_err(ctx(&path, "make the task cgroup"))?;
        if self.memory {
            let max = limits.max.map_or("max".to_string(), |b| b.to_string());
            std::fs::write(path.join("memory.max"), max).map_err(ctx(&path, "memory.max of"))?;
            if let Some(low) = limits.low {
                std::fs::write(path.join("memory.low"), low.to_string())
                    .map_err(ctx(&path, "memory.low of"))?;
            }
        }
        Ok(path)
    }
}

/// The cgroup parent `p` as a path: absolute as it is, relative under the cgroup2 mount
/// (`/proc/self/mountinfo`), as Nomad's `CustomPathCG2`.
pub fn resolve_parent(p: &Path) -> io::Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mount = info
        .lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2")
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .ok_or_else(|| {
            io::Error::other(format!(
                "cgroup_parent {}: no cgroup v2 filesystem is mounted (see /proc/self/mountinfo)",
                p.display()
            ))
        })?;
    Ok(mount.join(p))
}

/// Kills every process in `cgroup` (`cgroup.kill`), waits up to `wait` for it to empty, and
/// removes it (`lifeCG2.Kill`, `lifeCG2.Teardown`). A cgroup already gone is fine.
pub fn destroy(cgroup: &Path, wait: Duration) -> io::Result<()> {
    if !cgroup.exists() {
        return Ok(());
    }
    std::fs::write(cgroup.join("cgroup.kill"), "1").map_err(ctx(cgroup, "cgroup.kill of"))?;
    let deadline = Instant::now() + wait;
    loop {
        let events = std::fs::read_to_string(cgroup.join("cgroup.events")).unwrap_or_default();
        if !events.lines().any(|l| l == "populated 1") || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::remove_dir(cgroup).map_err(ctx(cgroup, "remove the task cgroup"))
}

/// Moves the calling process into `cgroup` (writes `0` to its `cgroup.procs`): what
/// `nomad-sim cgroup-exec` and the exec driver's helper do before they exec the task, so
/// that the task and all it starts are in the cgroup from their first instruction.
pub fn enter_self(cgroup: &Path) -> io::Result<()> {
    std::fs::write(cgroup.join("cgroup.procs"), "0").map_err(ctx(cgroup, "enter the cgroup"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_limits_follow_nomads_memory_limits() {
        const MIB: u64 = 1024 * 1024;
        assert_eq!(
            memory_limits(64, 0),
            MemoryLimits {
                max: Some(64 * MIB),
                low: None
            }
        );
        assert_eq!(
            memory_limits(64, 256),
            MemoryLimits {
                max: Some(256 * MIB),
                low: Some(64 * MIB)
            }
        );
        assert_eq!(
            memory_limits(64, -1),
            MemoryLimits {
                max: None,
                low: Some(64 * MIB)
            }
        );
    }
}
