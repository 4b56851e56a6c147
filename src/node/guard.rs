//! The placeholder guard: the tree of placeholder directories (`<state-dir>/mnt`) is a
//! read-only bind of a private directory (`<state-dir>/placeholders`), so a placeholder with
//! nothing published on it is an empty directory nobody can write to.
//!
//! Nomad binds a placeholder into a task (`MS_BIND | MS_REC`, as the exec and docker drivers
//! do); a bind keeps the source mount's read-only flag, so a task started without its
//! volume fails with EROFS instead of writing to the node's disk. A plugin's publish mounts
//! on the placeholder as on any directory, and a task bound later sees that mount; its
//! unpublish removes only its own mounts: the guard stays. Plugins see an ordinary
//! directory target, so the plugin protocol is unchanged. The agent creates and removes
//! placeholders through the writable backing directory, which no task is given.
//!
//! The guard is a shared mount with a peer group of its own: a publish on a placeholder
//! propagates into the tasks whose bind of it is a slave (Docker's `rslave`, Nomad's
//! `propagation_mode = "host-to-task"`). Docker refuses such a bind unless the mount its
//! source lives on is shared or slave ("... is mounted on ... but it is not a shared or slave
//! mount"), which a host whose `/` is private would not give; the guard does, on every host.

use crate::node::mounts::{MountTable, MountsError};
use nix::mount::MsFlags;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Why the guard could not be checked or placed.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// Mounts already stand below the placeholder root (published by an agent without the
    /// guard): placing the guard would hide them from new tasks while they stay alive.
    #[error("cannot guard {root}: {} mount(s) stand below it ({}); the guard is placed once they are unpublished", .mounts.len(), .mounts.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    MountsBelow { root: PathBuf, mounts: Vec<PathBuf> },
    /// Something else is mounted at the placeholder root.
    #[error("{root} is a mount point of something other than the guard ({found}); unmount it")]
    Occupied { root: PathBuf, found: String },
    /// A mount call failed.
    #[error("cannot {step} {path}: {source}")]
    Mount {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    /// A directory operation failed.
    #[error("cannot {step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Mounts(#[from] MountsError),
}

/// What stands at the placeholder root now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardState {
    /// The read-only bind of the backing directory is on top.
    Guarded,
    /// Nothing is mounted at the placeholder root: placeholders there are writable.
    Missing,
    /// Something mounted at the root is not the guard (why, for the report).
    Broken(String),
}

/// The guarded placeholder tree of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    root: PathBuf,
    backing: PathBuf,
}

impl Guard {
    /// The guard for a (resolved) state directory: placeholders under `<state>/mnt`, backed
    /// by `<state>/placeholders`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            root: state_dir.join("mnt"),
            backing: state_dir.join("placeholders"),
        }
    }

    /// Root of the placeholders (what Nomad's host volume paths point into).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the guard stands, by the mount `table` (this namespace's) and the kernel's
    /// inode of the root: the top mount at the root must be read-only and show the backing
    /// directory.
    pub fn check(&self, table: &MountTable) -> Result<GuardState, GuardError> {
        let Some(top) = table.top_at(&self.root) else {
            return Ok(GuardState::Missing);
        };
        let io = |step, path: &Path| {
            let path = path.to_path_buf();
            move |source| GuardError::Io { step, path, source }
        };
        let shown = std::fs::metadata(&self.root).map_err(io("stat", &self.root))?;
        let backing = std::fs::metadata(&self.backing).map_err(io("stat", &self.backing))?;
        if (shown.dev(), shown.ino()) != (backing.dev(), backing.ino()) {
            return Ok(GuardState::Broken(format!(
                "{} {} is mounted there",
                top.fs_type(),
                top.source()
            )));
        }
        if !top.read_only() {
            return Ok(GuardState::Broken("the guard is writable".into()));
        }
        Ok(GuardState::Guarded)
    }

    /// Places the guard (idempotent): bind the backing directory on the root, remount it
    /// read-only (and nosuid, nodev, noexec), and give it its own shared peer group, so
    /// mounts on placeholders reach the namespaces bound from it but not the backing path.
    pub fn establish(&self) -> Result<(), GuardError> {
        for d in [&self.root, &self.backing] {
            std::fs::create_dir_all(d).map_err(|source| GuardError::Io {
                step: "create",
                path: d.clone(),
                source,
            })?;
        }
        let table = MountTable::read_self()?;
        match self.check(&table)? {
            GuardState::Guarded => return Ok(()),
            GuardState::Broken(found) => {
                return Err(GuardError::Occupied {
                    root: self.root.clone(),
                    found,
                })
            }
            GuardState::Missing => {}
        }
        let below: Vec<PathBuf> = table
            .under(&self.root)
            .map(|e| e.mount_point().to_path_buf())
            .collect();
        if !below.is_empty() {
            return Err(GuardError::MountsBelow {
                root: self.root.clone(),
                mounts: below,
            });
        }
        let mount = |step, flags: MsFlags, src: Option<&Path>| {
            nix::mount::mount(src, &self.root, None::<&str>, flags, None::<&str>).map_err(
                |source| GuardError::Mount {
                    step,
                    path: self.root.clone(),
                    source,
                },
            )
        };
        mount(
            "bind the placeholders on",
            MsFlags::MS_BIND,
            Some(&self.backing),
        )?;
        let placed = mount(
            "make read-only",
            MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC,
            None,
        )
        .and_then(|()| mount("make private", MsFlags::MS_PRIVATE, None))
        .and_then(|()| mount("make shared", MsFlags::MS_SHARED, None));
        if let Err(e) = placed {
            // Never leave a writable bind behind.
            let _ = nix::mount::umount(&self.root);
            return Err(e);
        }
        Ok(())
    }
}

impl Guard {
    /// Makes sure the directory `target` exists: through the backing directory when it
    /// lies in the guarded tree, else directly (a target recorded before the guard).
    pub fn ensure(&self, target: &Path) -> Result<(), GuardError> {
        let dir = self.backing_of(target);
        std::fs::create_dir_all(&dir).map_err(|source| GuardError::Io {
            step: "create the placeholder",
            path: dir,
            source,
        })
    }

    /// Removes the (empty) directory `target` (rmdir: never deletes data); a missing
    /// one is fine.
    pub fn release(&self, target: &Path) -> Result<(), GuardError> {
        let dir = self.backing_of(target);
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(GuardError::Io {
                step: "remove the placeholder",
                path: dir,
                source: e,
            }),
            _ => Ok(()),
        }
    }

    /// The writable path of `target`: its twin under the backing directory when it lies
    /// under the root, else `target` itself.
    fn backing_of(&self, target: &Path) -> PathBuf {
        match target.strip_prefix(&self.root) {
            Ok(rel) if !rel.as_os_str().is_empty() => self.backing.join(rel),
            _ => target.to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::mounts::scratch::Scratch;

    fn write(dir: &Path) -> std::io::Result<()> {
        std::fs::write(dir.join("data.txt"), "written")
    }

    /// What a task of the exec driver does: in its own mount namespace, bind the
    /// placeholder (`MS_BIND | MS_REC`, then private) and write through the bind.
    fn task_writes(placeholder: &Path, inner: &Path) -> std::process::Output {
        std::fs::create_dir_all(inner).unwrap();
        std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount --rbind '{}' '{}' && mount --make-rprivate '{}' && echo task > '{}/task.txt'",
                placeholder.display(),
                inner.display(),
                inner.display(),
                inner.display()
            ))
            .output()
            .expect("run unshare (util-linux)")
    }

    fn erofs(r: std::io::Result<()>) -> bool {
        matches!(r, Err(e) if e.raw_os_error() == Some(nix::libc::EROFS))
    }

    /// The whole life of a guarded placeholder, with real mounts.
    #[test]
    fn a_guarded_placeholder_is_read_only_until_published() {
        let s = Scratch::new();
        let guard = Guard::new(&s.dir("state"));
        guard.establish().unwrap();
        guard.establish().unwrap();
        let table = MountTable::read_self().unwrap();
        assert_eq!(guard.check(&table).unwrap(), GuardState::Guarded);
        assert_eq!(table.count(guard.root()), 1, "establish is idempotent");
        // Shared, so that Docker accepts a `host-to-task` (rslave) bind of a placeholder.
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = info
            .lines()
            .find(|l| l.split(' ').nth(4) == guard.root().to_str())
            .unwrap();
        let optional: Vec<&str> = line.split(' ').skip(6).take_while(|f| *f != "-").collect();
        assert!(
            optional.iter().any(|f| f.starts_with("shared:")),
            "the guard is not a shared mount: {line}"
        );

        let target = guard.root().join("default/v1");
        guard.ensure(&target).unwrap();
        assert!(target.is_dir());
        assert!(erofs(write(&target)), "the placeholder itself is writable");

        // A task started without the volume: its driver binds the placeholder.
        let early = s.path().join("task-early/data");
        s.rbind(&target, &early);
        assert!(
            erofs(write(&early)),
            "a bind of the placeholder is writable"
        );
        assert!(
            erofs(std::fs::create_dir(early.join("d")).map(|_| ())),
            "mkdir in a bind of the placeholder"
        );

        let exec = task_writes(&target, &s.path().join("exec-task"));
        assert!(
            !exec.status.success()
                && String::from_utf8_lossy(&exec.stderr).contains("Read-only file system"),
            "a task in its own namespace wrote to the placeholder: {exec:?}"
        );

        // Publish: the plugin mounts on the placeholder; a task bound afterwards sees it.
        nix::mount::mount(
            Some("vol"),
            &target,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        write(&target).unwrap();
        let late = s.path().join("task-late/data");
        s.rbind(&target, &late);
        assert_eq!(
            std::fs::read_to_string(late.join("data.txt")).unwrap(),
            "written"
        );
        std::fs::write(late.join("more.txt"), "task").unwrap();
        assert!(target.join("more.txt").exists());
        let exec = task_writes(&target, &s.path().join("exec-task"));
        assert!(exec.status.success(), "{exec:?}");
        assert_eq!(
            std::fs::read_to_string(target.join("task.txt")).unwrap(),
            "task\n"
        );

        // Unpublish (the plugin unmounts its own mount): the guard stays, read-only, empty.
        nix::mount::umount(&late).unwrap();
        nix::mount::umount(&target).unwrap();
        let table = MountTable::read_self().unwrap();
        assert!(!table.contains(&target));
        assert_eq!(guard.check(&table).unwrap(), GuardState::Guarded);
        assert!(erofs(write(&target)));
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);

        // A placeholder with a mount on it cannot be removed; an idle one can.
        s.tmpfs("state/mnt/default/v1");
        let busy = guard.release(&target).unwrap_err();
        assert!(matches!(busy, GuardError::Io { .. }), "{busy}");
        nix::mount::umount(&target).unwrap();
        guard.release(&target).unwrap();
        assert!(!target.exists());
        guard.release(&target).unwrap();
        // A target outside the guarded tree (recorded before the guard) is made directly.
        let outside = s.path().join("elsewhere/v2");
        guard.ensure(&outside).unwrap();
        assert!(outside.is_dir());
        guard.release(&outside).unwrap();
        assert!(!outside.exists());
    }

    #[test]
    fn no_guard_over_live_mounts_or_foreign_mounts() {
        let s = Scratch::new();
        let state = s.dir("state");
        s.tmpfs("state/mnt/default/old");
        let guard = Guard::new(&state);
        let err = guard.establish().unwrap_err();
        assert!(
            matches!(err, GuardError::MountsBelow { ref mounts, .. } if mounts.len() == 1),
            "{err}"
        );
        nix::mount::umount(&state.join("mnt/default/old")).unwrap();

        s.tmpfs("state/mnt");
        let table = MountTable::read_self().unwrap();
        assert!(matches!(
            guard.check(&table).unwrap(),
            GuardState::Broken(_)
        ));
        assert!(matches!(
            guard.establish().unwrap_err(),
            GuardError::Occupied { .. }
        ));
        nix::mount::umount(guard.root()).unwrap();
        let table = MountTable::read_self().unwrap();
        assert_eq!(guard.check(&table).unwrap(), GuardState::Missing);
        guard.establish().unwrap();
    }
}
