//! Paths beneath a storage root, resolved once and used by handle (issue 33 §3).
//!
//! A plugin that checks a path (`realpath`) and then uses it again (`mount --bind`, `rm -rf`,
//! `losetup`) resolves it twice: whoever may write somewhere along it (a task writing inside
//! its own volume, when another volume's storage lies below it) can swap a directory for a
//! symlink in between, and the second resolution leaves the root (the host's `/etc` mounted
//! into a job). Here every path is resolved once, beneath its storage root, with no symlink
//! followed (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`;
//! on a kernel without `openat2`, a walk of `openat(O_PATH | O_NOFOLLOW)` one component at a
//! time), and what follows uses the handle: a bind mount from `/proc/self/fd/N`, a removal
//! by `unlinkat` relative to opened directories, `mkdirat`, `renameat`, or a command given
//! the file as `/proc/self/fd/N`. Plugins reach this through `dhv-binder helper`
//! (docs/plugin-protocol.md, "Paths are used by handle").
//!
//! The roots are the node's configuration (`DHV_VOLUMES_DIR` and `DHV_ALLOWED_ROOTS`): a
//! root itself is opened as configured (symlinks in it followed); nothing beneath it is.

use crate::volume::mount_options::{Atime, MountFlags};
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{self, AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// Why a path beneath a storage root was refused or could not be used.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    /// The path is not absolute, or has a `.` or `..` component.
    #[error("path {path:?} must be absolute with no '.' or '..' component: refused")]
    BadPath { path: PathBuf },
    /// The path lies under none of the node's storage roots.
    #[error("{path} is under none of this node's storage roots ({roots}): refused (the roots are DHV_VOLUMES_DIR and DHV_ALLOWED_ROOTS, from the agent's --volumes-dir and --plugin-root)")]
    NotUnderRoot { path: PathBuf, roots: String },
    /// A component beneath the root is a symbolic link: nothing beneath a root is reached
    /// through one, since whoever can write there could point it anywhere.
    #[error("{component} is a symbolic link (resolving {path} beneath the storage root {root}): refused; nothing beneath a storage root is followed through a symlink")]
    Symlink {
        component: PathBuf,
        path: PathBuf,
        root: PathBuf,
    },
    /// The kernel says the resolution would leave the root (`EXDEV` from `openat2`).
    #[error("{path} escapes the storage root {root}: refused")]
    Escapes { path: PathBuf, root: PathBuf },
    /// A component beneath the root is missing.
    #[error("{component} does not exist (resolving {path} beneath the storage root {root})")]
    Missing {
        component: PathBuf,
        path: PathBuf,
        root: PathBuf,
    },
    /// A component that must be a directory is not one.
    #[error("{component} is not a directory (resolving {path} beneath the storage root {root})")]
    NotADirectory {
        component: PathBuf,
        path: PathBuf,
        root: PathBuf,
    },
    /// The operation would act on a storage root itself (remove or rename one).
    #[error("{path} is a storage root itself: refused (only what lies beneath a root may be removed or renamed)")]
    IsRoot { path: PathBuf },
    /// Removing a tree met a directory on another filesystem (a mount point).
    #[error("{path} is on another filesystem than the tree being removed (a mount point): not removing across a mount boundary; unmount it first")]
    CrossesMount { path: PathBuf },
    /// Two paths of one rename lie under different roots.
    #[error("{from} and {to} lie under different storage roots: a rename stays beneath one root")]
    DifferentRoots { from: PathBuf, to: PathBuf },
    /// A system call failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path, e: Errno) -> BeneathError {
    BeneathError::Io {
        what,
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// The node's storage roots a plugin may act beneath.
#[derive(Debug, Clone, Default)]
pub struct Roots(Vec<PathBuf>);

impl Roots {
    /// The given roots (absolute directories; others are ignored).
    pub fn new(roots: impl IntoIterator<Item = PathBuf>) -> Self {
        Self(
            roots
                .into_iter()
                .filter(|r| r.is_absolute())
                .collect::<Vec<_>>(),
        )
    }

    /// The roots the agent gives a plugin call: `DHV_VOLUMES_DIR`, then each entry of the
    /// `:`-separated `DHV_ALLOWED_ROOTS`.
    pub fn from_env() -> Self {
        let mut v = Vec::new();
        if let Some(d) = std::env::var_os("DHV_VOLUMES_DIR") {
            v.push(PathBuf::from(d));
        }
        if let Some(a) = std::env::var_os("DHV_ALLOWED_ROOTS") {
            for r in a.as_bytes().split(|b| *b == b':') {
                if !r.is_empty() {
                    v.push(PathBuf::from(std::ffi::OsStr::from_bytes(r)));
                }
            }
        }
        Self::new(v)
    }

    fn describe(&self) -> String {
        if self.0.is_empty() {
            return "none configured".into();
        }
        self.0
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Each root as configured and as resolved (a root given through a symlink matches
    /// paths written either way).
    fn forms(&self) -> Vec<(PathBuf, PathBuf)> {
        let mut out = Vec::new();
        for r in &self.0 {
            out.push((r.clone(), r.clone()));
            if let Ok(c) = r.canonicalize() {
                if &c != r {
                    out.push((c, r.clone()));
                }
            }
        }
        out
    }

    /// Finds the root `path` lies under (the deepest one) and opens it.
    pub fn locate(&self, path: &Path) -> Result<Beneath, BeneathError> {
        let bad = || BeneathError::BadPath {
            path: path.to_path_buf(),
        };
        let raw = path.as_os_str().as_bytes();
        if !path.is_absolute() || raw.split(|b| *b == b'/').any(|c| c == b"." || c == b"..") {
            return Err(bad());
        }
        let mut best: Option<(PathBuf, PathBuf, PathBuf)> = None;
        for (form, configured) in self.forms() {
            if let Ok(rel) = path.strip_prefix(&form) {
                let deeper = best
                    .as_ref()
                    .is_none_or(|(f, _, _)| form.components().count() > f.components().count());
                if deeper {
                    best = Some((form, configured, rel.to_path_buf()));
                }
            }
        }
        let (_, root, rel) = best.ok_or_else(|| BeneathError::NotUnderRoot {
            path: path.to_path_buf(),
            roots: self.describe(),
        })?;
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(bad());
        }
        let root_fd = fs::open(
            &root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("cannot open the storage root", &root, e))?;
        Ok(Beneath {
            root,
            root_fd,
            rel,
            path: path.to_path_buf(),
        })
    }
}

/// A path located beneath one storage root, with the root opened.
#[derive(Debug)]
pub struct Beneath {
    root: PathBuf,
    root_fd: OwnedFd,
    /// The path relative to the root (empty: the root itself).
    rel: PathBuf,
    path: PathBuf,
}

impl Beneath {
    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the path with `flags` (`O_CLOEXEC` added), following no symlink beneath the
    /// root; with `O_CREAT` a missing last component is created with `mode`.
    pub fn open(&self, flags: OFlags, mode: Mode) -> Result<OwnedFd, BeneathError> {
        let rel: &Path = if self.rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            &self.rel
        };
        // O_PATH with O_NOFOLLOW would return a handle on a trailing symlink itself.
        let flags = flags | OFlags::CLOEXEC;
        let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match fs::openat2(&self.root_fd, rel, flags, mode, how) {
            Ok(fd) => Ok(fd),
            // No openat2 on this kernel (before 5.6), or a filter that hides it: the walk.
            Err(Errno::NOSYS) => self.walk(flags, mode),
            Err(Errno::LOOP) | Err(Errno::NOENT) | Err(Errno::NOTDIR) => {
                // Name the component: the walk finds the same fault (or, if the tree
                // changed meanwhile, opens what is there now, equally safely).
                self.walk(flags, mode)
            }
            Err(Errno::XDEV) => Err(BeneathError::Escapes {
                path: self.path.clone(),
                root: self.root.clone(),
            }),
            Err(e) => Err(io("cannot open", &self.path, e)),
        }
    }

    /// The component-by-component walk: each directory opened with
    /// `O_PATH | O_NOFOLLOW | O_DIRECTORY` relative to the one before.
    fn walk(&self, flags: OFlags, mode: Mode) -> Result<OwnedFd, BeneathError> {
        let names: Vec<&std::ffi::OsStr> = self.rel.iter().collect();
        let Some((last, dirs)) = names.split_last() else {
            return fs::openat(&self.root_fd, ".", flags, mode)
                .map_err(|e| io("cannot open", &self.path, e));
        };
        let mut cur = self.root.clone();
        let mut fd = fs::openat(
            &self.root_fd,
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("cannot open", &self.root, e))?;
        for name in dirs {
            cur.push(name);
            fd = self.step(&fd, name, &cur)?;
        }
        cur.push(last);
        match fs::openat(&fd, *last, flags | OFlags::NOFOLLOW, mode) {
            Ok(f) => {
                // O_PATH | O_NOFOLLOW opens a symlink itself: refuse it.
                let st = fs::fstat(&f).map_err(|e| io("cannot stat", &cur, e))?;
                if FileType::from_raw_mode(st.st_mode) == FileType::Symlink {
                    return Err(self.symlink(cur));
                }
                Ok(f)
            }
            Err(Errno::NOENT) => Err(self.missing(cur)),
            Err(Errno::LOOP) | Err(Errno::NOTDIR) => Err(self.symlink_or_not_dir(&fd, last, cur)),
            Err(e) => Err(io("cannot open", &cur, e)),
        }
    }

    /// The error for `name` in `dir` that could not be opened as a directory: a symlink, or
    /// something else that is not a directory.
    fn symlink_or_not_dir(
        &self,
        dir: &OwnedFd,
        name: &std::ffi::OsStr,
        cur: PathBuf,
    ) -> BeneathError {
        match fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => self.symlink(cur),
            _ => self.not_dir(cur),
        }
    }

    /// Opens directory `name` in `dir` (an `O_PATH` handle), refusing a symlink.
    fn step(
        &self,
        dir: &OwnedFd,
        name: &std::ffi::OsStr,
        cur: &Path,
    ) -> Result<OwnedFd, BeneathError> {
        match fs::openat(
            dir,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(f) => Ok(f),
            Err(Errno::NOENT) => Err(self.missing(cur.to_path_buf())),
            Err(Errno::NOTDIR) | Err(Errno::LOOP) => {
                Err(self.symlink_or_not_dir(dir, name, cur.to_path_buf()))
            }
            Err(e) => Err(io("cannot open", cur, e)),
        }
    }

    fn symlink(&self, component: PathBuf) -> BeneathError {
        BeneathError::Symlink {
            component,
            path: self.path.clone(),
            root: self.root.clone(),
        }
    }

    fn missing(&self, component: PathBuf) -> BeneathError {
        BeneathError::Missing {
            component,
            path: self.path.clone(),
            root: self.root.clone(),
        }
    }

    fn not_dir(&self, component: PathBuf) -> BeneathError {
        BeneathError::NotADirectory {
            component,
            path: self.path.clone(),
            root: self.root.clone(),
        }
    }

    /// The parent directory (opened with `O_PATH`, beneath the root, no symlink followed)
    /// and the last component's name. Refused for a root itself.
    fn parent(&self) -> Result<(OwnedFd, OsString), BeneathError> {
        let (Some(name), Some(parent)) = (self.rel.file_name(), self.rel.parent()) else {
            return Err(BeneathError::IsRoot {
                path: self.path.clone(),
            });
        };
        let p = Beneath {
            root: self.root.clone(),
            root_fd: self.root_fd.try_clone().map_err(|e| BeneathError::Io {
                what: "cannot duplicate the handle of",
                path: self.root.clone(),
                source: e,
            })?,
            rel: parent.to_path_buf(),
            path: self.path.parent().unwrap_or(Path::new("/")).to_path_buf(),
        };
        let fd = p.open(OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
        Ok((fd, name.to_os_string()))
    }
}

/// `/proc/self/fd/N` of a handle: the kernel resolves it to the very file or directory the
/// handle was opened on, wherever its path now leads.
pub fn proc_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Bind-mounts the directory `source` (beneath its root, no symlink followed) onto `target`
/// (a directory; the agent's placeholder, not followed if it is a symlink), from the
/// handle, with `flags` (`nosuid,nodev` unless the volume's spec asks otherwise) and, with
/// `read_only`, read-only. A flag the source's own mount has (read-only, `nosuid`, ...) is
/// kept, never lifted.
///
/// The mount is complete before it becomes visible (issue 44 §4): a bind onto a shared
/// mount propagates at once into every slave copy (a task bound with Nomad's
/// `propagation_mode = "host-to-task"`), and a remount made afterwards reaches none of them.
/// So the source is cloned as a detached mount (`open_tree(OPEN_TREE_CLONE)`, by handle),
/// attached in a private mount namespace of a short-lived thread where nothing propagates,
/// given its flags there (`MS_REMOUNT | MS_BIND`), cloned again (the clone keeps them) and
/// only then attached onto the target (`move_mount`), which propagates it with its flags.
///
/// Errors: the source refused ([`Beneath::open`]); a system call failed, among them
/// `ENOSYS` on a kernel without `open_tree`/`move_mount` (before Linux 5.2), where a mount
/// cannot be made read-only before a task sees it: refused rather than done unsafely.
pub fn bind_mount(
    source: &Beneath,
    target: &Path,
    read_only: bool,
    flags: MountFlags,
) -> Result<(), BeneathError> {
    use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};
    let src = source.open(OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
    let tgt = fs::open(
        target,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("cannot open the target", target, e))?;
    let ms = ms_flags(&src, read_only, flags, &source.path)?;
    let sys = |what: &'static str| {
        move |e: Errno| BeneathError::Io {
            what,
            path: source.path.clone(),
            source: if e == Errno::NOSYS {
                std::io::Error::other(
                    "this kernel has no open_tree/move_mount (Linux 5.2): a mount cannot be made read-only, nosuid and nodev before a task sees it; refused",
                )
            } else {
                e.into()
            },
        }
    };
    let tree = open_tree(
        &src,
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )
    .map_err(sys("cannot clone the mount of"))?;
    let target_owned = target.to_path_buf();
    let finished = std::thread::Builder::new()
        .name("dhv-bind-staging".into())
        .spawn(move || staged(tree, &target_owned, ms))
        .map_err(|e| BeneathError::Io {
            what: "cannot start the staging thread for",
            path: source.path.clone(),
            source: e,
        })?
        .join()
        .map_err(|_| BeneathError::Io {
            what: "the staging thread panicked for",
            path: source.path.clone(),
            source: std::io::Error::other("panic"),
        })??;
    move_mount(
        &finished,
        "",
        &tgt,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(|e| BeneathError::Io {
        what: "cannot mount onto the target",
        path: target.to_path_buf(),
        source: e.into(),
    })
}

/// The `MS_*` flags of the remount: `flags` and `read_only`, plus every restriction the
/// source's own mount has (from `fstatvfs` of the handle).
fn ms_flags(
    src: &OwnedFd,
    read_only: bool,
    flags: MountFlags,
    path: &Path,
) -> Result<nix::mount::MsFlags, BeneathError> {
    use nix::mount::MsFlags;
    use rustix::fs::StatVfsMountFlags as St;
    let have = fs::fstatvfs(src)
        .map_err(|e| io("cannot read the mount flags of", path, e))?
        .f_flag;
    let mut ms = MsFlags::MS_REMOUNT | MsFlags::MS_BIND;
    let mut set = |on: bool, st: St, f: MsFlags| {
        if on || have.contains(st) {
            ms |= f;
        }
    };
    set(read_only, St::RDONLY, MsFlags::MS_RDONLY);
    set(!flags.suid, St::NOSUID, MsFlags::MS_NOSUID);
    set(!flags.dev, St::NODEV, MsFlags::MS_NODEV);
    set(flags.noexec, St::NOEXEC, MsFlags::MS_NOEXEC);
    set(flags.nodiratime, St::NODIRATIME, MsFlags::MS_NODIRATIME);
    match flags.atime {
        Some(Atime::NoAtime) => ms |= MsFlags::MS_NOATIME,
        Some(Atime::StrictAtime) => ms |= MsFlags::MS_STRICTATIME,
        // relatime is the kernel's default for a remount without the others.
        Some(Atime::RelAtime) => {}
        None if have.contains(St::NOATIME) => ms |= MsFlags::MS_NOATIME,
        None => {}
    }
    Ok(ms)
}

/// The restrictions the mount at `path` has now (`statvfs`), as the `MS_*` flags a bind
/// remount must repeat to keep them: `nosuid`, `nodev`, `noexec`, `noatime`,
/// `nodiratime` (a bind remount sets every per-mount flag; one left out is lifted).
pub fn restrictions_at(path: &Path) -> nix::Result<nix::mount::MsFlags> {
    use nix::mount::MsFlags;
    use nix::sys::statvfs::FsFlags;
    let have = nix::sys::statvfs::statvfs(path)?.flags();
    let mut ms = MsFlags::empty();
    for (st, f) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
    ] {
        if have.contains(st) {
            ms |= f;
        }
    }
    Ok(ms)
}

/// In this thread's own mount namespace (private: nothing mounted here reaches any other
/// namespace), attaches the detached `tree`, gives it `ms`, and returns a detached clone
/// of it, which carries those flags. The namespace ends with the thread.
fn staged(tree: OwnedFd, target: &Path, ms: nix::mount::MsFlags) -> Result<OwnedFd, BeneathError> {
    use nix::mount::{mount, MsFlags};
    use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};
    let fail = |what: &'static str| {
        move |e: Errno| BeneathError::Io {
            what,
            path: target.to_path_buf(),
            source: e.into(),
        }
    };
    let nix_fail = |what: &'static str| {
        move |e: nix::Error| BeneathError::Io {
            what,
            path: target.to_path_buf(),
            source: e.into(),
        }
    };
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).map_err(nix_fail(
        "cannot make a private mount namespace to prepare the mount for",
    ))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(nix_fail("cannot make the staging namespace private for"))?;
    // Where the tree is attached in this namespace matters to nobody (nothing here
    // propagates, and the tree is used by its own handle from now on).
    let point = fs::open(
        target,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(fail("cannot open the staging point"))?;
    move_mount(
        &tree,
        "",
        &point,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(fail("cannot attach the staged mount for"))?;
    mount(
        None::<&str>,
        &proc_path(tree.as_fd()),
        None::<&str>,
        ms,
        None::<&str>,
    )
    .map_err(nix_fail(
        "cannot set the mount flags (read-only, nosuid, nodev, ...) of",
    ))?;
    open_tree(
        &tree,
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )
    .map_err(fail("cannot clone the staged mount for"))
}

/// Removes `path` (a file, or a directory and everything in it) beneath its root, following
/// no symlink (a symlink inside is removed, not followed) and crossing no mount (a
/// directory on another filesystem fails the removal). A missing path is success
/// (`Ok(false)`); a root itself is refused.
pub fn remove(path: &Beneath) -> Result<bool, BeneathError> {
    // A missing ancestor means there is nothing to remove, as a missing path does.
    let (parent, name) = match path.parent() {
        Ok(p) => p,
        Err(BeneathError::Missing { .. }) => return Ok(false),
        Err(e) => return Err(e),
    };
    let st = match fs::statat(&parent, &name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(false),
        Err(e) => return Err(io("cannot stat", &path.path, e)),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        fs::unlinkat(&parent, &name, AtFlags::empty())
            .map_err(|e| io("cannot remove", &path.path, e))?;
        return Ok(true);
    }
    let dir = fs::openat(
        &parent,
        &name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("cannot open", &path.path, e))?;
    let dev = fs::fstat(&dir)
        .map_err(|e| io("cannot stat", &path.path, e))?
        .st_dev;
    empty_dir(&dir, dev, &path.path)?;
    fs::unlinkat(&parent, &name, AtFlags::REMOVEDIR)
        .map_err(|e| io("cannot remove the directory", &path.path, e))?;
    Ok(true)
}

/// Removes everything in the open directory `dir` (on device `dev`), by handle.
fn empty_dir(dir: &OwnedFd, dev: u64, at: &Path) -> Result<(), BeneathError> {
    let mut names = Vec::new();
    for entry in fs::Dir::read_from(dir).map_err(|e| io("cannot list", at, e))? {
        let entry = entry.map_err(|e| io("cannot list", at, e))?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(OsString::from(std::ffi::OsStr::from_bytes(n)));
        }
    }
    for name in names {
        let p = at.join(&name);
        let st = match fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(io("cannot stat", &p, e)),
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            if st.st_dev != dev {
                return Err(BeneathError::CrossesMount { path: p });
            }
            let sub = fs::openat(
                dir,
                &name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| io("cannot open", &p, e))?;
            if fs::fstat(&sub)
                .map_err(|e| io("cannot stat", &p, e))?
                .st_dev
                != dev
            {
                return Err(BeneathError::CrossesMount { path: p });
            }
            empty_dir(&sub, dev, &p)?;
            fs::unlinkat(dir, &name, AtFlags::REMOVEDIR)
                .map_err(|e| io("cannot remove the directory", &p, e))?;
        } else {
            match fs::unlinkat(dir, &name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io("cannot remove", &p, e)),
            }
        }
    }
    Ok(())
}

/// Owner and mode for [`make_dir`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DirAttrs {
    /// uid and gid to give the last directory.
    pub owner: Option<(u32, u32)>,
    /// Permission bits to give the last directory (e.g. 0o755).
    pub mode: Option<u32>,
}

/// Makes directory `path` beneath its root, one `mkdirat` at a time relative to the
/// directory opened before it (no symlink followed); with `parents`, missing parents too
/// and an existing directory is success. `attrs` are applied to the last directory by
/// handle (`fchown`, `fchmod`), also when it existed.
pub fn make_dir(path: &Beneath, parents: bool, attrs: DirAttrs) -> Result<(), BeneathError> {
    let names: Vec<&std::ffi::OsStr> = path.rel.iter().collect();
    let mut cur = path.root.clone();
    let mut fd = fs::openat(
        &path.root_fd,
        ".",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("cannot open", &path.root, e))?;
    for (i, name) in names.iter().enumerate() {
        let last = i + 1 == names.len();
        cur.push(name);
        match fs::mkdirat(&fd, *name, Mode::from_raw_mode(0o755)) {
            Ok(()) => {}
            Err(Errno::EXIST) if parents || !last => {}
            Err(Errno::NOENT) => return Err(path.missing(cur)),
            Err(e) => return Err(io("cannot make the directory", &cur, e)),
        }
        fd = path.step(&fd, name, &cur)?;
    }
    if attrs.owner.is_some() || attrs.mode.is_some() {
        // fchown and fchmod need a real handle, not an O_PATH one.
        let d = fs::openat(
            &fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("cannot open", &cur, e))?;
        if let Some((u, g)) = attrs.owner {
            fs::fchown(
                &d,
                Some(rustix::fs::Uid::from_raw(u)),
                Some(rustix::fs::Gid::from_raw(g)),
            )
            .map_err(|e| io("cannot change the owner of", &cur, e))?;
        }
        if let Some(m) = attrs.mode {
            fs::fchmod(&d, Mode::from_raw_mode(m))
                .map_err(|e| io("cannot change the mode of", &cur, e))?;
        }
    }
    Ok(())
}

/// Renames `from` to `to`, both beneath the same root, relative to their opened parent
/// directories (`renameat`; an existing `to` is replaced as rename(2) does).
pub fn rename(from: &Beneath, to: &Beneath) -> Result<(), BeneathError> {
    if from.root != to.root {
        return Err(BeneathError::DifferentRoots {
            from: from.path.clone(),
            to: to.path.clone(),
        });
    }
    let (fp, fname) = from.parent()?;
    let (tp, tname) = to.parent()?;
    fs::renameat(&fp, &fname, &tp, &tname).map_err(|e| BeneathError::Io {
        what: "cannot rename",
        path: from.path.clone(),
        source: std::io::Error::from(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, Roots, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("precious"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("a/link")).unwrap();
        (dir, Roots::new([root.clone()]), outside)
    }

    #[test]
    fn a_symlink_beneath_the_root_is_named_and_refused_by_every_operation() {
        let (dir, roots, outside) = setup();
        let root = dir.path().join("root");
        let through = root.join("a/link/precious");
        let b = roots.locate(&through).unwrap();
        let e = b.open(OFlags::PATH, Mode::empty()).unwrap_err();
        assert!(
            matches!(&e, BeneathError::Symlink { component, .. } if component == &root.join("a/link")),
            "{e}"
        );
        assert!(e.to_string().contains("a/link is a symbolic link"), "{e}");
        assert!(matches!(remove(&b), Err(BeneathError::Symlink { .. })));
        assert!(matches!(
            make_dir(
                &roots.locate(&root.join("a/link/new")).unwrap(),
                true,
                DirAttrs::default()
            ),
            Err(BeneathError::Symlink { .. })
        ));
        // The link itself is removed, not followed.
        assert!(remove(&roots.locate(&root.join("a/link")).unwrap()).unwrap());
        assert!(outside.join("precious").exists());
        // The same through the walk (a kernel without openat2).
        std::os::unix::fs::symlink(&outside, root.join("a/link")).unwrap();
        let e = roots
            .locate(&through)
            .unwrap()
            .walk(OFlags::PATH, Mode::empty())
            .unwrap_err();
        assert!(matches!(e, BeneathError::Symlink { .. }), "{e}");
    }

    #[test]
    fn paths_outside_the_roots_or_with_dots_and_the_roots_themselves_are_refused() {
        let (dir, roots, outside) = setup();
        let root = dir.path().join("root");
        assert!(matches!(
            roots.locate(&outside),
            Err(BeneathError::NotUnderRoot { .. })
        ));
        assert!(matches!(
            roots.locate(&root.join("a/../../outside")),
            Err(BeneathError::BadPath { .. })
        ));
        assert!(matches!(
            roots.locate(Path::new("relative")),
            Err(BeneathError::BadPath { .. })
        ));
        assert!(matches!(
            remove(&roots.locate(&root).unwrap()),
            Err(BeneathError::IsRoot { .. })
        ));
    }

    /// The options of the mount at `path`, from this process's mount table (the kernel's
    /// word, not the plugin's): the per-mount options (field 6) of the topmost mount there.
    fn options_at(path: &Path) -> Vec<String> {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = info
            .lines()
            .rfind(|l| l.split(' ').nth(4) == path.to_str())
            .unwrap_or_else(|| panic!("nothing mounted at {}", path.display()));
        line.split(' ')
            .nth(5)
            .unwrap()
            .split(',')
            .map(String::from)
            .collect()
    }

    fn erofs(r: std::io::Result<()>) -> bool {
        matches!(r, Err(e) if e.raw_os_error() == Some(nix::libc::EROFS))
    }

    /// Issue 44 §4: a read-only publish onto a shared placeholder reaches a task bound
    /// before it (a slave copy, Nomad's `host-to-task`) read-only, `nosuid` and `nodev`.
    /// A bind then a remount propagated the bind at once and the remount never: the task's
    /// copy was writable.
    #[test]
    fn a_read_only_publish_reaches_a_slave_copy_made_before_it_read_only() {
        use crate::node::mounts::scratch::Scratch;
        use nix::mount::{mount, MsFlags};
        let s = Scratch::new();
        let root = s.dir("root");
        let vol = s.dir("root/vol");
        std::fs::write(vol.join("f"), "f").unwrap();
        // The guard: a shared mount holding the placeholder.
        let guard = s.dir("guard");
        s.rbind(&guard, &guard);
        mount(
            None::<&str>,
            &guard,
            None::<&str>,
            MsFlags::MS_SHARED,
            None::<&str>,
        )
        .unwrap();
        let placeholder = s.dir("guard/p");
        // A task bound before the publish, host-to-task: a slave copy of the guard.
        let task = s.path().join("task");
        s.rbind(&guard, &task);
        mount(
            None::<&str>,
            &task,
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_SLAVE,
            None::<&str>,
        )
        .unwrap();

        let roots = Roots::new([root]);
        bind_mount(
            &roots.locate(&vol).unwrap(),
            &placeholder,
            true,
            MountFlags::default(),
        )
        .unwrap();
        let seen = task.join("p");
        assert_eq!(std::fs::read_to_string(seen.join("f")).unwrap(), "f");
        assert!(
            erofs(std::fs::write(seen.join("g"), "task")),
            "the task's copy of a read-only publish is writable: {:?}",
            options_at(&seen)
        );
        assert!(erofs(std::fs::write(placeholder.join("g"), "host")));
        for o in ["ro", "nosuid", "nodev"] {
            assert!(
                options_at(&seen).iter().any(|x| x == o),
                "{o}: {:?}",
                options_at(&seen)
            );
            assert!(options_at(&placeholder).iter().any(|x| x == o));
        }
        assert!(!vol.join("g").exists());
    }

    /// Issue 49: the published mount carries `nosuid,nodev` by default and the spec's
    /// flags (`noexec`) on top, as the mount table shows; a setuid binary brought into the
    /// volume does not run setuid through it.
    #[test]
    fn a_publish_is_nosuid_nodev_by_default_and_carries_the_specs_flags() {
        use crate::node::mounts::scratch::Scratch;
        use std::os::unix::fs::PermissionsExt;
        let s = Scratch::new();
        let root = s.dir("root");
        let vol = s.dir("root/vol");
        let roots = Roots::new([root]);
        // A setuid-root copy of `id`, as a task with root in its volume could leave there.
        std::fs::copy("/usr/bin/id", vol.join("id")).unwrap();
        std::fs::set_permissions(vol.join("id"), std::fs::Permissions::from_mode(0o4755)).unwrap();
        std::fs::set_permissions(s.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let euid_through = |dir: &Path| {
            let out = std::process::Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .arg(dir.join("id"))
                .arg("-u")
                .output()
                .expect("run setpriv (util-linux)");
            assert!(out.status.success(), "{out:?}");
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        // The test's own premise: the source's filesystem honours setuid.
        assert_eq!(
            euid_through(&vol),
            "0",
            "the scratch filesystem is mounted nosuid"
        );

        let plain = s.dir("plain");
        bind_mount(
            &roots.locate(&vol).unwrap(),
            &plain,
            false,
            MountFlags::default(),
        )
        .unwrap();
        let o = options_at(&plain);
        assert!(
            o.contains(&"nosuid".into()) && o.contains(&"nodev".into()),
            "{o:?}"
        );
        assert!(
            !o.contains(&"noexec".into()) && o.contains(&"rw".into()),
            "{o:?}"
        );
        assert_eq!(
            euid_through(&plain),
            "65534",
            "a setuid binary ran setuid: {o:?}"
        );

        let noexec = s.dir("noexec");
        let flags = MountFlags::parse(&["noexec"]).unwrap();
        bind_mount(&roots.locate(&vol).unwrap(), &noexec, false, flags).unwrap();
        let o = options_at(&noexec);
        for f in ["noexec", "nosuid", "nodev", "rw"] {
            assert!(o.contains(&f.into()), "{f}: {o:?}");
        }
        let ran = std::process::Command::new(noexec.join("id")).output();
        assert!(
            matches!(&ran, Err(e) if e.raw_os_error() == Some(nix::libc::EACCES)),
            "{ran:?}"
        );

        // Asked for: suid honoured (the spec's explicit choice).
        let suid = s.dir("suid");
        let flags = MountFlags::parse(&["suid"]).unwrap();
        bind_mount(&roots.locate(&vol).unwrap(), &suid, false, flags).unwrap();
        assert!(!options_at(&suid).contains(&"nosuid".into()));
        assert_eq!(euid_through(&suid), "0");
    }

    #[test]
    fn a_tree_is_removed_by_handle_and_mkdir_sets_owner_and_mode() {
        let (dir, roots, outside) = setup();
        let root = dir.path().join("root");
        let v = root.join("ns/vol");
        make_dir(
            &roots.locate(&v).unwrap(),
            true,
            DirAttrs {
                owner: None,
                mode: Some(0o750),
            },
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&v).unwrap().permissions().mode() & 0o7777,
            0o750
        );
        std::fs::create_dir_all(v.join("d/e")).unwrap();
        std::fs::write(v.join("d/e/f"), "f").unwrap();
        std::os::unix::fs::symlink(&outside, v.join("d/out")).unwrap();
        assert!(remove(&roots.locate(&v).unwrap()).unwrap());
        assert!(!v.exists());
        assert!(outside.join("precious").exists());
        assert!(!remove(&roots.locate(&v).unwrap()).unwrap());
        // A missing ancestor: nothing to remove either.
        assert!(!remove(&roots.locate(&v.join("gone/x")).unwrap()).unwrap());
        // rename beneath one root
        make_dir(&roots.locate(&v).unwrap(), true, DirAttrs::default()).unwrap();
        rename(
            &roots.locate(&v).unwrap(),
            &roots.locate(&root.join("ns/vol2")).unwrap(),
        )
        .unwrap();
        assert!(root.join("ns/vol2").is_dir());
    }
}
