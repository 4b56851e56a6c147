//! The host the agent serves: its mount namespace (the agent must run in it) and the real
//! paths of the directories the agent works in, both checked once at start.
//!
//! A mount made in a private mount namespace (`unshare -m`, systemd `PrivateMounts=yes`,
//! a container without the host's mount namespace) is seen by nobody else: Nomad's bind
//! mounts into tasks would find an empty placeholder. So the agent refuses to start there.

use crate::node::mounts::{MountTable, MountsError};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Why the agent must not start on this host. The CLI exits with code 64 (EX_USAGE): the
/// way the agent is run must change, retrying does not help.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The agent's mount namespace is not pid 1's.
    #[error("dhv-binder runs in a private mount namespace (not pid 1's): its mounts would be invisible to Nomad and to tasks. Run it in the host's mount namespace (Nomad raw_exec driver; no `unshare -m`, no systemd PrivateMounts=/ProtectSystem=/ReadWritePaths=, no container without the host's mounts)")]
    PrivateMountNamespace,
    /// A mount table could not be read.
    #[error(transparent)]
    Mounts(#[from] MountsError),
    /// A working directory cannot be created or resolved.
    #[error("cannot create or resolve {what} {path}: {source}")]
    Dir {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Checks that this process runs in the host's mount namespace: the one of pid 1.
///
/// A mount belongs to exactly one namespace, and mount IDs are unique across namespaces
/// while they exist; a new namespace gets copies with new IDs. So two tables share an ID
/// only if they are the same namespace. (Comparing `/proc/self/ns/mnt` with
/// `/proc/1/ns/mnt` would say the same, but reading pid 1's link needs ptrace access to
/// pid 1, which a root process may lack under a hardened kernel or an LSM.)
pub fn check_mount_namespace() -> Result<(), HostError> {
    let host = MountTable::read()?;
    let mine = MountTable::read_self()?;
    if same_namespace(&host, &mine) {
        Ok(())
    } else {
        Err(HostError::PrivateMountNamespace)
    }
}

/// True when the two tables were read from the same mount namespace (they share a mount
/// ID). Two reads of one namespace taken apart in time still share every mount that
/// outlived the interval, such as the root mount.
pub fn same_namespace(a: &MountTable, b: &MountTable) -> bool {
    let ids: BTreeSet<u32> = a.ids().collect();
    b.ids().any(|id| ids.contains(&id))
}

/// The agent's working directories, created and resolved to real paths (no symlink, no
/// `..`), so every path the agent compares with the mount table is the kernel's spelling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirs {
    /// `--state-dir`, resolved.
    pub state_dir: PathBuf,
    /// `--volumes-dir` (default `<state-dir>/volumes`), resolved.
    pub volumes_dir: PathBuf,
}

impl Dirs {
    /// Creates (if missing) and resolves the state and volumes directories.
    pub fn resolve(state_dir: &Path, volumes_dir: &Path) -> Result<Self, HostError> {
        Ok(Self {
            state_dir: resolve_dir("the state directory", state_dir)?,
            volumes_dir: resolve_dir("the volumes directory", volumes_dir)?,
        })
    }

    /// Resolves the directories of `cfg` and writes the real paths back into it, so every
    /// path derived from it (journal, placeholders, plugin environment) is real.
    pub fn apply(cfg: &mut crate::config::AgentConfig) -> Result<Self, HostError> {
        let dirs = Self::resolve(&cfg.state_dir, &cfg.volumes_dir())?;
        cfg.state_dir = dirs.state_dir.clone();
        cfg.volumes_dir = Some(dirs.volumes_dir.clone());
        Ok(dirs)
    }
}

fn resolve_dir(what: &'static str, path: &Path) -> Result<PathBuf, HostError> {
    let err = |source| HostError::Dir {
        what,
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(path).map_err(err)?;
    std::fs::canonicalize(path).map_err(err)
}

/// Every start-up check of the host, in order: the mount namespace, then the directories
/// (written back into `cfg`).
pub fn preflight(cfg: &mut crate::config::AgentConfig) -> Result<Dirs, HostError> {
    check_mount_namespace()?;
    Dirs::apply(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_runs_in_the_host_namespace() {
        check_mount_namespace().unwrap();
    }

    /// A process in a new mount namespace (`unshare -m`, as systemd's PrivateMounts does)
    /// shares no mount with pid 1.
    #[test]
    fn a_private_namespace_shares_no_mount_id() {
        let _serial = crate::node::mounts::scratch::serial();
        let out = std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "unchanged",
                "cat",
                "/proc/self/mountinfo",
            ])
            .output()
            .expect("run unshare (util-linux)");
        assert!(out.status.success(), "unshare failed: {out:?}");
        let private = MountTable::parse(&out.stdout, Path::new("private")).unwrap();
        let host = MountTable::read().unwrap();
        assert!(!private.entries().is_empty());
        assert!(!same_namespace(&host, &private));
        assert!(same_namespace(&host, &MountTable::read_self().unwrap()));
    }

    #[test]
    fn dirs_are_created_and_resolved() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let state = link.join("x").join("..").join("state");
        let d = Dirs::resolve(&state, &state.join("volumes")).unwrap();
        let real = std::fs::canonicalize(&real).unwrap();
        assert_eq!(d.state_dir, real.join("state"));
        assert_eq!(d.volumes_dir, real.join("state").join("volumes"));
        assert!(d.volumes_dir.is_dir());
    }

    #[test]
    fn an_unusable_dir_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("file");
        std::fs::write(&file, "").unwrap();
        let err = Dirs::resolve(&file.join("state"), &file.join("v")).unwrap_err();
        assert!(matches!(err, HostError::Dir { .. }), "{err}");
    }
}
