//! The `exec` driver's isolation helper (`nomad-sim exec-task <spec.json>`).
//!
//! Runs single-threaded before any async runtime: unshares the mount namespace, makes `/`
//! recursively private, builds the chroot in the task dir from `chroot_env` (read-only binds),
//! binds `/proc` and `/dev`, binds the shared alloc dir at `/alloc`, bind-mounts each host volume
//! at its destination (recursively, so a mount point under the host path is carried along;
//! read-only when requested), chroots and execs the command. Every mount lives only in the task's
//! private namespace and vanishes with it. Models `drivers/exec` + `drivers/shared/executor`
//! (`executor_linux.go`, libcontainer mounts).

use nix::mount::{mount, MsFlags};
use serde::{Deserialize, Serialize};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

/// One bind mount into the chroot.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct BindSpec {
    /// Host path.
    pub source: PathBuf,
    /// Absolute path inside the chroot.
    pub destination: String,
    /// Remount read-only.
    pub read_only: bool,
    /// "private" | "host-to-task" | "bidirectional".
    pub propagation: String,
}

/// What the helper needs, written as JSON by the task runner.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct ExecSpec {
    /// The task dir, used as the chroot root.
    pub root: PathBuf,
    /// Host path of the shared `alloc/` dir (mounted at `/alloc`).
    pub alloc_dir: PathBuf,
    /// chroot_env entries (host → chroot path).
    pub chroot: Vec<(String, String)>,
    /// Host volume mounts.
    pub volumes: Vec<BindSpec>,
    /// Command (resolved inside the chroot with the task's PATH).
    pub command: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Full environment.
    pub env: Vec<(String, String)>,
}

/// Errors of the helper; printed to the task's stderr log, exit code 1.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// Reading or decoding the spec.
    #[error("reading exec spec: {0}")]
    Spec(String),
    /// A mount or namespace syscall failed.
    #[error("{0}: {1}")]
    Sys(String, nix::Error),
    /// Filesystem preparation failed.
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    /// exec failed.
    #[error("failed to exec {0}: {1}")]
    Exec(String, std::io::Error),
}

fn inside(root: &Path, dest: &str) -> PathBuf {
    root.join(dest.trim_start_matches('/'))
}

fn prepare_target(source: &Path, target: &Path) -> Result<(), ExecError> {
    let is_dir = std::fs::metadata(source)
        .map_err(|e| ExecError::Io(format!("stat {}", source.display()), e))?
        .is_dir();
    if is_dir {
        std::fs::create_dir_all(target)
            .map_err(|e| ExecError::Io(format!("mkdir {}", target.display()), e))?;
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| ExecError::Io(format!("mkdir {}", parent.display()), e))?;
        }
        if !target.exists() {
            std::fs::File::create(target)
                .map_err(|e| ExecError::Io(format!("create {}", target.display()), e))?;
        }
    }
    Ok(())
}

fn bind(source: &Path, target: &Path, read_only: bool, propagation: &str) -> Result<(), ExecError> {
    prepare_target(source, target)?;
    let what = format!("bind {} → {}", source.display(), target.display());
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| ExecError::Sys(what.clone(), e))?;
    if read_only {
        mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(|e| ExecError::Sys(format!("{what} (read-only)"), e))?;
    }
    let prop = match propagation {
        "host-to-task" => MsFlags::MS_SLAVE,
        "bidirectional" => MsFlags::MS_SHARED,
        _ => MsFlags::MS_PRIVATE,
    };
    mount(
        None::<&str>,
        target,
        None::<&str>,
        prop | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| ExecError::Sys(format!("{what} (propagation)"), e))?;
    Ok(())
}

/// Sets up the namespace and chroot, then execs. Returns only on error.
pub fn run(spec_path: &Path) -> ExecError {
    match setup_and_exec(spec_path) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

fn setup_and_exec(spec_path: &Path) -> Result<std::convert::Infallible, ExecError> {
    let raw = std::fs::read(spec_path).map_err(|e| ExecError::Spec(e.to_string()))?;
    let spec: ExecSpec =
        serde_json::from_slice(&raw).map_err(|e| ExecError::Spec(e.to_string()))?;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| ExecError::Sys("unshare(CLONE_NEWNS)".into(), e))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| ExecError::Sys("make / rprivate".into(), e))?;
    let root = &spec.root;
    for (src, dest) in &spec.chroot {
        let src = Path::new(src);
        if !src.exists() {
            continue;
        }
        bind(src, &inside(root, dest), true, "private")?;
    }
    let proc_dir = inside(root, "/proc");
    std::fs::create_dir_all(&proc_dir).map_err(|e| ExecError::Io("mkdir proc".into(), e))?;
    if mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::empty(),
        None::<&str>,
    )
    .is_err()
    {
        bind(Path::new("/proc"), &proc_dir, false, "private")?;
    }
    bind(Path::new("/dev"), &inside(root, "/dev"), false, "private")?;
    bind(&spec.alloc_dir, &inside(root, "/alloc"), false, "private")?;
    for v in &spec.volumes {
        bind(
            &v.source,
            &inside(root, &v.destination),
            v.read_only,
            &v.propagation,
        )?;
    }
    nix::unistd::chroot(root)
        .map_err(|e| ExecError::Sys(format!("chroot {}", root.display()), e))?;
    std::env::set_current_dir("/").map_err(|e| ExecError::Io("chdir /".into(), e))?;
    let err = std::process::Command::new(&spec.command)
        .args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .exec();
    Err(ExecError::Exec(spec.command.clone(), err))
}
