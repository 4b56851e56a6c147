//! The `exec` driver's isolation helper (`nomad-sim exec-task <spec.json>`).
//!
//! Runs single-threaded before any async runtime: unshares the mount namespace, makes `/`
//! recursively a slave (libcontainer's default root propagation, `MS_SLAVE | MS_REC`, which
//! Nomad's executor keeps: `drivers/shared/executor/executor_linux_cgo.go` sets no
//! `RootPropagation`; runc `libcontainer/rootfs_linux.go` `prepareRoot`), so that a host
//! volume bound with `propagation_mode = "host-to-task"` receives the host's later mounts
//! as in Nomad and nothing of the task's reaches the host, builds the chroot in the task dir from `chroot_env` (read-only binds,
//! parents before nested destinations),
//! binds `/proc` and `/dev`, binds the shared alloc dir at `/alloc`, bind-mounts each host volume
//! at its destination (recursively, so a mount point under the host path is carried along;
//! read-only when requested), pivots into the task dir (the old root detached) and execs the command. Every mount lives only in the task's
//! private namespace and vanishes with it. Models `drivers/exec` + `drivers/shared/executor`
//! (`executor_linux.go`, libcontainer mounts).
//!
//! The command runs as the task's `user`, `nobody` when the task sets none (Nomad:
//! `drivers/exec/driver.go` `StartTask`), looked up in the host's user database before the
//! pivot (`drivers/shared/executor/executor_linux_cgo.go` `Launch`: `users.Lookup`, then
//! `USER`, `LOGNAME` and `HOME` added to the environment). An unknown user fails the start.
//! Stricter than Nomad on purpose: a non-root task gets the user's primary group (Nomad leaves
//! the group at 0) and no capabilities (Nomad grants its default set, DAC_OVERRIDE included,
//! unless the client's `allow_caps` or the task's `cap_drop` narrow it), so a task writes only
//! where the user itself may: what a hardened client allows. `user = "root"` runs as root.
//!
//! Nomad builds the chroot by copying `chroot_env` into the task dir, so an entry may land
//! inside another one (`"/usr" = "/usr"` plus a file at `/usr/local/bin/x`). Here the outer
//! entry is a read-only bind of the host directory, so a missing mount point inside it cannot be
//! created there (and must never be: that would write into the host's `/usr`). Instead the
//! deepest existing directory above the mount point gets a tmpfs-backed overlay (lower = that
//! directory as bound, upper on a small tmpfs) in the task's namespace; the mount point is
//! created in the overlay's upper layer and the overlay is made read-only once every mount is in.

use nix::mount::{mount, MsFlags};
use serde::{Deserialize, Serialize};
use std::os::fd::AsRawFd;
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
    /// The user the command runs as: the task's `user`, or `nobody` when it sets none.
    #[serde(default = "nobody")]
    pub user: String,
    /// The task's cgroup, entered first (see [`crate::cgroup`]); `None`: none.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
}

fn nobody() -> String {
    "nobody".into()
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
    /// The task's user is not in the host's user database (Nomad: "failed host user
    /// validation").
    #[error("failed host user validation: user {0:?} not found")]
    User(String),
}

fn inside(root: &Path, dest: &str) -> PathBuf {
    root.join(dest.trim_start_matches('/'))
}

fn create_target(source: &Path, target: &Path) -> std::io::Result<()> {
    if std::fs::metadata(source)?.is_dir() {
        std::fs::create_dir_all(target)
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if !target.exists() {
            std::fs::File::create(target)?;
        }
        Ok(())
    }
}

/// Creates the mount point `target` for `source`; when it would have to be created inside a
/// read-only bind (a nested chroot_env destination or volume), first covers the deepest existing
/// directory above it with a writable overlay (see the module doc), recorded in `overlays`.
fn prepare_target(
    source: &Path,
    target: &Path,
    overlays: &mut Vec<PathBuf>,
) -> Result<(), ExecError> {
    let err = match create_target(source, target) {
        Ok(()) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(nix::libc::EROFS) => e,
        Err(e) => {
            return Err(ExecError::Io(
                format!("mount point {}", target.display()),
                e,
            ))
        }
    };
    let Some(existing) = target.ancestors().skip(1).find(|a| a.is_dir()) else {
        return Err(ExecError::Io(
            format!("mount point {}", target.display()),
            err,
        ));
    };
    writable_overlay(existing)?;
    overlays.push(existing.to_path_buf());
    create_target(source, target)
        .map_err(|e| ExecError::Io(format!("mount point {} (in overlay)", target.display()), e))
}

/// Mounts an overlay on `dir` whose lower layer is `dir` as it is now and whose upper layer
/// lives on a fresh 1 MiB tmpfs, so mount points can be made there without touching the host.
fn writable_overlay(dir: &Path) -> Result<(), ExecError> {
    let what = format!("overlay on {}", dir.display());
    // Keep the current directory reachable once the tmpfs covers it.
    let lower = std::fs::File::open(dir).map_err(|e| ExecError::Io(what.clone(), e))?;
    mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("size=1m,mode=0755"),
    )
    .map_err(|e| ExecError::Sys(format!("{what} (tmpfs)"), e))?;
    let (upper, work) = (dir.join(".upper"), dir.join(".work"));
    for d in [&upper, &work] {
        std::fs::create_dir(d).map_err(|e| ExecError::Io(format!("{what} (mkdir)"), e))?;
    }
    let opts = format!(
        "lowerdir=/proc/self/fd/{},upperdir={},workdir={}",
        lower.as_raw_fd(),
        upper.display(),
        work.display()
    );
    mount(
        Some("overlay"),
        dir,
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    )
    .map_err(|e| ExecError::Sys(what, e))?;
    Ok(())
}

fn bind(
    source: &Path,
    target: &Path,
    read_only: bool,
    propagation: &str,
    overlays: &mut Vec<PathBuf>,
) -> Result<(), ExecError> {
    prepare_target(source, target, overlays)?;
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

/// Makes `root` the task's `/` the way libcontainer does (`rootfs_linux.go`, `pivotRoot`):
/// bind it onto itself (recursively, carrying the mounts made inside it), `pivot_root(".", ".")`
/// and detach the old root. The task's namespace then holds only its own mounts. A bare
/// `chroot` would keep a copy of every host mount of that moment in the namespace, so the task
/// would hold other allocations' volumes (busy loop devices, refused unpublishes) as no task of
/// real Nomad does.
fn enter_root(root: &Path) -> Result<(), ExecError> {
    mount(
        Some(root),
        root,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| ExecError::Sys(format!("bind {} onto itself", root.display()), e))?;
    std::env::set_current_dir(root)
        .map_err(|e| ExecError::Io(format!("chdir {}", root.display()), e))?;
    nix::unistd::pivot_root(".", ".")
        .map_err(|e| ExecError::Sys(format!("pivot_root {}", root.display()), e))?;
    nix::mount::umount2(".", nix::mount::MntFlags::MNT_DETACH)
        .map_err(|e| ExecError::Sys("detach the old root".into(), e))?;
    std::env::set_current_dir("/").map_err(|e| ExecError::Io("chdir /".into(), e))
}

/// Sets up the namespace and the task's root, then execs. Returns only on error.
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
    if let Some(cg) = &spec.cgroup {
        crate::cgroup::enter_self(cg).map_err(|e| ExecError::Io("cgroup".into(), e))?;
    }
    // Looked up on the host, before the task's root replaces it.
    let user = nix::unistd::User::from_name(&spec.user)
        .ok()
        .flatten()
        .ok_or_else(|| ExecError::User(spec.user.clone()))?;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| ExecError::Sys("unshare(CLONE_NEWNS)".into(), e))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(|e| ExecError::Sys("make / rslave".into(), e))?;
    let root = &spec.root;
    let mut overlays = Vec::new();
    // Outer destinations first, so a nested one is bound on top of its parent.
    let mut chroot = spec.chroot.clone();
    chroot.sort_by_key(|(_, dest)| Path::new(dest).components().count());
    for (src, dest) in &chroot {
        let src = Path::new(src);
        if !src.exists() {
            continue;
        }
        bind(src, &inside(root, dest), true, "private", &mut overlays)?;
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
        bind(
            Path::new("/proc"),
            &proc_dir,
            false,
            "private",
            &mut overlays,
        )?;
    }
    bind(
        Path::new("/dev"),
        &inside(root, "/dev"),
        false,
        "private",
        &mut overlays,
    )?;
    bind(
        &spec.alloc_dir,
        &inside(root, "/alloc"),
        false,
        "private",
        &mut overlays,
    )?;
    for v in &spec.volumes {
        bind(
            &v.source,
            &inside(root, &v.destination),
            v.read_only,
            &v.propagation,
            &mut overlays,
        )?;
    }
    // The overlays only held mount points: read-only like the chroot_env binds they cover.
    for dir in &overlays {
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(|e| ExecError::Sys(format!("overlay on {} (read-only)", dir.display()), e))?;
    }
    enter_root(root)?;
    let mut cmd = std::process::Command::new(&spec.command);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env("USER", &user.name)
        .env("LOGNAME", &user.name)
        .env("HOME", &user.dir);
    if !user.uid.is_root() {
        // setgid, then setgroups(0) and setuid (std's order): the user's own group only, and
        // the change of uid from root clears every capability.
        cmd.gid(user.gid.as_raw()).uid(user.uid.as_raw());
    }
    let err = cmd.exec();
    Err(ExecError::Exec(spec.command.clone(), err))
}
