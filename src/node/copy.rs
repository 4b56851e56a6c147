//! A directory tree copied by handle (issue 44 §2): what `dhv-binder helper copy` does for a
//! plugin's snapshot, clone and create-from-snapshot.
//!
//! `cp -a SRC/. DST/` walks by name: every file it copies is found again from `SRC` through
//! each directory on the way, so a task that writes in the volume being copied can swap one
//! of its directories for a symlink (`renameat2(RENAME_EXCHANGE)`) while `cp` is inside it,
//! and `cp` then copies whatever the symlink points at (the host's root-only files, handed to
//! whoever restores the snapshot). Here the source and the destination are opened once beneath
//! their storage roots ([`Beneath::open`]: `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`),
//! and every entry below is reached only relative to the handle of the directory that lists
//! it: opened with `openat(O_PATH | O_NOFOLLOW)`, its kind taken from that handle (`fstat`),
//! a directory read through its own handle (a directory renamed away mid-walk is still read
//! where it is, never through a name), a regular file reopened from the handle
//! (`/proc/self/fd/N`, the same inode), a symlink copied as a symlink (`readlinkat` of the
//! handle, never followed). Nothing the walk reads can lie outside the source tree: every
//! name is one component looked up in a directory of the tree, with no symlink followed and
//! no `..`. The destination is made the same way: `mkdirat`, `openat(O_CREAT | O_EXCL |
//! O_NOFOLLOW)`, `symlinkat`, `mknodat` relative to handles of directories this copy made; an
//! entry that already exists there fails the copy.
//!
//! Kept as `cp -a` keeps them: contents (holes stay holes where the source filesystem reports
//! them with `SEEK_DATA`/`SEEK_HOLE`), owner and group, permission bits (setuid, setgid,
//! sticky included), access and modification times, hard links within the tree, symlinks,
//! FIFOs and sockets (as empty nodes). Not kept: extended attributes and ACLs (a file
//! capability in `security.capability` would give a restored program privileges nobody
//! granted in the new volume). Refused: device nodes (a task with `CAP_MKNOD` could otherwise
//! hand the host's disks to whoever restores the snapshot; remove them from the volume) and a
//! directory on another filesystem (a mount inside the tree; unmount it first).

use super::beneath::{proc_path, Beneath, BeneathError};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{self, AtFlags, FileType, Mode, OFlags, SeekFrom, Stat, Timespec, Timestamps};
use rustix::io::Errno;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// At most this many multiply-linked files are remembered (one handle each) to link their
/// other names to the same copy; past it, further names are copied as separate files.
const MAX_LINKED: usize = 4096;

/// Why a tree could not be copied.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The source or the destination could not be opened beneath its root (a symlink, a
    /// path outside the roots, a missing directory).
    #[error(transparent)]
    Beneath(#[from] BeneathError),
    /// A device node in the source: not copied, the copy fails.
    #[error("{path} is a device node: refused (a copy never makes device nodes; remove it from the volume and try again)")]
    Device { path: PathBuf },
    /// A directory in the source on another filesystem (a mount inside the tree).
    #[error("{path} is on another filesystem than the tree being copied (a mount point): not copying across a mount boundary; unmount it first")]
    CrossesMount { path: PathBuf },
    /// An entry of the destination already exists.
    #[error("{path} already exists: a copy is made into an empty directory (remove it first)")]
    Exists { path: PathBuf },
    /// A system call failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path, e: Errno) -> CopyError {
    CopyError::Io {
        what,
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// What one copy made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copied {
    /// Directories made below the destination (not counting the destination itself).
    pub dirs: u64,
    /// Regular files copied (each hard link of one file counted once).
    pub files: u64,
    /// Symbolic links made (copied as links, never followed).
    pub symlinks: u64,
    /// FIFOs and sockets made (empty nodes).
    pub nodes: u64,
    /// Extra names of a file linked to its copy (hard links kept).
    pub links: u64,
    /// Bytes of file contents copied.
    pub bytes: u64,
}

/// Copies everything in the directory `src` into the existing, empty directory `dst`, both
/// beneath their storage roots, and gives `dst` the owner, mode and times of `src` (as
/// `cp -a SRC/. DST/` does), by handle (see the module's documentation).
///
/// Errors: [`CopyError`]; a copy that fails part-way leaves what it made in `dst` (the
/// caller copies into a fresh directory and renames it into place only on success).
pub fn copy_tree(src: &Beneath, dst: &Beneath) -> Result<Copied, CopyError> {
    copy_with(src, dst, &mut |_| {})
}

/// [`copy_tree`] with `hook` called with each entry's path (relative to `src`) just before
/// the entry is opened: where a copy by name would be steered by a swap.
fn copy_with(
    src: &Beneath,
    dst: &Beneath,
    hook: &mut dyn FnMut(&Path),
) -> Result<Copied, CopyError> {
    let s = src.open(OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
    let d = dst.open(OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
    let st = fs::fstat(&s).map_err(|e| io("cannot stat", src.path(), e))?;
    let mut w = Walker {
        src: src.path().to_path_buf(),
        dst: dst.path().to_path_buf(),
        dev: st.st_dev,
        linked: HashMap::new(),
        copied: Copied::default(),
        hook,
    };
    w.dir(&s, &d, Path::new(""))?;
    w.attrs(&st, &d, Path::new(""))?;
    Ok(w.copied)
}

struct Walker<'h> {
    src: PathBuf,
    dst: PathBuf,
    /// The source tree's filesystem.
    dev: u64,
    /// Multiply-linked source files already copied: (device, inode) → the copy's handle.
    linked: HashMap<(u64, u64), OwnedFd>,
    copied: Copied,
    hook: &'h mut dyn FnMut(&Path),
}

impl Walker<'_> {
    /// Copies the entries of the source directory `s` (read through its handle) into the
    /// destination directory `d`; `rel` is their path relative to the roots of the copy.
    fn dir(&mut self, s: &OwnedFd, d: &OwnedFd, rel: &Path) -> Result<(), CopyError> {
        for name in names(s).map_err(|e| io("cannot list", &self.src.join(rel), e))? {
            let p = rel.join(&name);
            (self.hook)(&p);
            let e = match fs::openat(
                s,
                &name,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(e) => e,
                // Removed since the listing: as if it had been removed before.
                Err(Errno::NOENT) => continue,
                Err(err) => return Err(io("cannot open", &self.src.join(&p), err)),
            };
            // The kind of what was opened, not of what a name now leads to.
            let st = fs::fstat(&e).map_err(|err| io("cannot stat", &self.src.join(&p), err))?;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => {
                    if st.st_dev != self.dev {
                        return Err(CopyError::CrossesMount {
                            path: self.src.join(&p),
                        });
                    }
                    let sub = fs::openat(
                        &e,
                        ".",
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(|err| io("cannot open", &self.src.join(&p), err))?;
                    self.create(fs::mkdirat(d, &name, Mode::from_raw_mode(0o700)), &p)?;
                    let dsub = fs::openat(
                        d,
                        &name,
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(|err| io("cannot open", &self.dst.join(&p), err))?;
                    self.copied.dirs += 1;
                    self.dir(&sub, &dsub, &p)?;
                    // After the contents: their creation changed its times, and its mode
                    // may forbid writing into it.
                    self.attrs(&st, &dsub, &p)?;
                }
                FileType::RegularFile => self.file(&e, &st, d, &name, &p)?,
                FileType::Symlink => {
                    let target = fs::readlinkat(&e, "", Vec::new())
                        .map_err(|err| io("cannot read the symlink", &self.src.join(&p), err))?;
                    self.create(fs::symlinkat(target.as_c_str(), d, &name), &p)?;
                    self.node_attrs(&st, d, &name, &p, false)?;
                    self.copied.symlinks += 1;
                }
                t @ (FileType::Fifo | FileType::Socket) => {
                    self.create(fs::mknodat(d, &name, t, Mode::from_raw_mode(0o600), 0), &p)?;
                    self.node_attrs(&st, d, &name, &p, true)?;
                    self.copied.nodes += 1;
                }
                FileType::CharacterDevice | FileType::BlockDevice => {
                    return Err(CopyError::Device {
                        path: self.src.join(&p),
                    })
                }
                FileType::Unknown => {
                    return Err(io(
                        "cannot copy (unknown file type)",
                        &self.src.join(&p),
                        Errno::INVAL,
                    ))
                }
            }
        }
        Ok(())
    }

    /// The result of making destination entry `rel`: an existing one is [`CopyError::Exists`].
    fn create(&self, r: rustix::io::Result<()>, rel: &Path) -> Result<(), CopyError> {
        r.map_err(|e| self.create_error(e, rel))
    }

    /// The error of making `rel` beneath the destination: [`CopyError::Exists`] for `EEXIST`.
    fn create_error(&self, e: Errno, rel: &Path) -> CopyError {
        match e {
            Errno::EXIST => CopyError::Exists {
                path: self.dst.join(rel),
            },
            e => io("cannot make", &self.dst.join(rel), e),
        }
    }

    /// Copies the regular file opened as `e` (an `O_PATH` handle) to `name` in `d`, or links
    /// `name` to the copy of the same file made before.
    fn file(
        &mut self,
        e: &OwnedFd,
        st: &Stat,
        d: &OwnedFd,
        name: &OsStr,
        rel: &Path,
    ) -> Result<(), CopyError> {
        let key = (st.st_dev, st.st_ino);
        if st.st_nlink > 1 {
            if let Some(first) = self.linked.get(&key) {
                if fs::linkat(first, "", d, name, AtFlags::EMPTY_PATH).is_ok() {
                    self.copied.links += 1;
                    return Ok(());
                }
            }
        }
        // The very inode opened above, whatever its name now leads to.
        let input = fs::open(
            proc_path(e.as_fd()),
            OFlags::RDONLY | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|err| io("cannot open", &self.src.join(rel), err))?;
        let out = match fs::openat(
            d,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(o) => o,
            Err(err) => return Err(self.create_error(err, rel)),
        };
        self.copied.bytes += contents(&input, &out, st.st_size as u64)
            .map_err(|err| io("cannot copy the contents of", &self.src.join(rel), err))?;
        self.attrs(st, &out, rel)?;
        self.copied.files += 1;
        if st.st_nlink > 1 && self.linked.len() < MAX_LINKED {
            self.linked.insert(key, out);
        }
        Ok(())
    }

    /// Gives the destination entry opened as `fd` the owner, mode and times in `st`.
    fn attrs(&self, st: &Stat, fd: &OwnedFd, rel: &Path) -> Result<(), CopyError> {
        let at = || self.dst.join(rel);
        match fs::fchown(
            fd,
            Some(fs::Uid::from_raw(st.st_uid)),
            Some(fs::Gid::from_raw(st.st_gid)),
        ) {
            // Not root: the copy stays the caller's, as with `cp -a`.
            Ok(()) | Err(Errno::PERM) => {}
            Err(e) => return Err(io("cannot change the owner of", &at(), e)),
        }
        // After the owner: a change of owner clears setuid and setgid.
        fs::fchmod(fd, Mode::from_raw_mode(st.st_mode & 0o7777))
            .map_err(|e| io("cannot change the mode of", &at(), e))?;
        fs::futimens(fd, &times(st)).map_err(|e| io("cannot set the times of", &at(), e))
    }

    /// Owner, times and (with `mode`) permission bits of the entry `name` in `d`, which this
    /// copy made (a symlink is not followed).
    fn node_attrs(
        &self,
        st: &Stat,
        d: &OwnedFd,
        name: &OsStr,
        rel: &Path,
        mode: bool,
    ) -> Result<(), CopyError> {
        let at = || self.dst.join(rel);
        match fs::chownat(
            d,
            name,
            Some(fs::Uid::from_raw(st.st_uid)),
            Some(fs::Gid::from_raw(st.st_gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        ) {
            Ok(()) | Err(Errno::PERM) => {}
            Err(e) => return Err(io("cannot change the owner of", &at(), e)),
        }
        if mode {
            fs::chmodat(
                d,
                name,
                Mode::from_raw_mode(st.st_mode & 0o7777),
                AtFlags::empty(),
            )
            .map_err(|e| io("cannot change the mode of", &at(), e))?;
        }
        fs::utimensat(d, name, &times(st), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io("cannot set the times of", &at(), e))
    }
}

/// The names in the directory `dir` (read through its handle), without `.` and `..`.
fn names(dir: &OwnedFd) -> rustix::io::Result<Vec<OsString>> {
    let mut out = Vec::new();
    for entry in fs::Dir::read_from(dir)? {
        let n = entry?.file_name().to_bytes().to_vec();
        if n != b"." && n != b".." {
            out.push(OsString::from(OsStr::from_bytes(&n)));
        }
    }
    Ok(out)
}

#[allow(clippy::unnecessary_cast)]
fn times(st: &Stat) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: st.st_atime as i64,
            tv_nsec: st.st_atime_nsec as _,
        },
        last_modification: Timespec {
            tv_sec: st.st_mtime as i64,
            tv_nsec: st.st_mtime_nsec as _,
        },
    }
}

/// Copies the contents of `input` (`size` bytes) to the empty file `out`, leaving holes
/// where the source has them (`SEEK_DATA`/`SEEK_HOLE`; the whole file where the filesystem
/// does not say). Returns the bytes copied.
fn contents(input: &OwnedFd, out: &OwnedFd, size: u64) -> rustix::io::Result<u64> {
    let mut copied = 0;
    let mut pos = 0u64;
    while pos < size {
        let data = match fs::seek(input, SeekFrom::Data(pos)) {
            Ok(d) => d,
            // No data after pos: the rest is a hole.
            Err(Errno::NXIO) => break,
            // No SEEK_DATA here: copy everything.
            Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) => pos,
            Err(e) => return Err(e),
        };
        let end = match fs::seek(input, SeekFrom::Hole(data)) {
            Ok(h) => h.min(size),
            Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) | Err(Errno::NXIO) => size,
            Err(e) => return Err(e),
        };
        copied += range(input, out, data, end)?;
        pos = end.max(data + 1);
    }
    // The length, holes at the end included.
    fs::ftruncate(out, size)?;
    Ok(copied)
}

/// Copies bytes `from..to` of `input` to the same offsets of `out`: `copy_file_range`, or
/// reads and writes where the kernel cannot (across filesystems on older kernels).
fn range(input: &OwnedFd, out: &OwnedFd, from: u64, to: u64) -> rustix::io::Result<u64> {
    let (mut off_in, mut off_out) = (from, from);
    while off_in < to {
        let want = usize::try_from(to - off_in)
            .unwrap_or(usize::MAX)
            .min(1 << 30);
        match fs::copy_file_range(input, Some(&mut off_in), out, Some(&mut off_out), want) {
            // The file got shorter while being copied: what is left is a hole.
            Ok(0) => break,
            Ok(_) => {}
            Err(Errno::XDEV) | Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) | Err(Errno::NOSYS) => {
                return by_reads(input.as_fd(), out.as_fd(), from, to);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(off_in - from)
}

fn by_reads(
    input: BorrowedFd<'_>,
    out: BorrowedFd<'_>,
    from: u64,
    to: u64,
) -> rustix::io::Result<u64> {
    let mut buf = vec![0u8; 1 << 16];
    let mut off = from;
    while off < to {
        let want = buf
            .len()
            .min(usize::try_from(to - off).unwrap_or(usize::MAX));
        let n = rustix::io::pread(input, &mut buf[..want], off)?;
        if n == 0 {
            break;
        }
        let mut done = 0;
        while done < n {
            done += rustix::io::pwrite(out, &buf[done..n], off + done as u64)?;
        }
        off += n as u64;
    }
    Ok(off - from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::beneath::Roots;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    const OUTSIDE: &str = "outside the storage roots";

    /// A root holding `src` (a volume with a file, a subdirectory of files, a symlink to
    /// the outside directory) and an empty `dst`; the outside directory has the same names
    /// as `src/sub`, holding OUTSIDE.
    fn setup() -> (tempfile::TempDir, Roots, PathBuf, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        let src = root.join("src");
        std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
        std::fs::create_dir_all(outside.join("deeper")).unwrap();
        std::fs::create_dir_all(root.join("dst")).unwrap();
        std::fs::write(src.join("top"), "inside").unwrap();
        for i in 0..20 {
            std::fs::write(src.join(format!("sub/f{i}")), "inside").unwrap();
            std::fs::write(outside.join(format!("f{i}")), OUTSIDE).unwrap();
        }
        std::fs::write(src.join("sub/deeper/g"), "inside").unwrap();
        std::fs::write(outside.join("deeper/g"), OUTSIDE).unwrap();
        std::os::unix::fs::symlink(&outside, src.join("link")).unwrap();
        (
            dir,
            Roots::new([root.clone()]),
            src,
            root.join("dst"),
            outside,
        )
    }

    /// Every regular file under `dir` (symlinks not followed) whose contents are OUTSIDE.
    fn from_outside(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                out.extend(from_outside(&p));
            } else if m.is_file() && std::fs::read_to_string(&p).unwrap() == OUTSIDE {
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn a_tree_is_copied_with_owners_modes_times_links_and_symlinks_as_links() {
        let (_dir, roots, src, dst, outside) = setup();
        std::fs::set_permissions(src.join("top"), std::fs::Permissions::from_mode(0o4751)).unwrap();
        std::os::unix::fs::chown(src.join("sub/f1"), Some(65534), Some(65533)).unwrap();
        std::fs::hard_link(src.join("top"), src.join("sub/top-again")).unwrap();
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o750)).unwrap();
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            src.join("pipe"),
            Mode::from_raw_mode(0o640),
        )
        .unwrap();
        // A sparse file: 1 MiB with 5 bytes written at its end.
        let sparse = std::fs::File::create(src.join("sparse")).unwrap();
        sparse.set_len(1 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&sparse, b"tail!", (1 << 20) - 5).unwrap();
        drop(sparse);
        let got = copy_tree(&roots.locate(&src).unwrap(), &roots.locate(&dst).unwrap()).unwrap();
        assert_eq!(got.files, 23, "{got:?}");
        assert_eq!((got.links, got.symlinks, got.nodes, got.dirs), (1, 1, 1, 2));
        assert_eq!(
            std::fs::read_to_string(dst.join("sub/deeper/g")).unwrap(),
            "inside"
        );
        let m = |p: &str| std::fs::symlink_metadata(dst.join(p)).unwrap();
        let s = |p: &str| std::fs::symlink_metadata(src.join(p)).unwrap();
        assert_eq!(m("top").mode() & 0o7777, 0o4751);
        assert_eq!((m("sub/f1").uid(), m("sub/f1").gid()), (65534, 65533));
        assert_eq!(m("sub/top-again").ino(), m("top").ino(), "hard link kept");
        assert_eq!(m("").mode() & 0o7777, 0o750, "the top directory's mode");
        assert_eq!(m("sub").mtime(), s("sub").mtime());
        assert_eq!(m("top").mtime_nsec(), s("top").mtime_nsec());
        assert!(std::os::unix::fs::FileTypeExt::is_fifo(
            &m("pipe").file_type()
        ));
        assert_eq!(m("pipe").mode() & 0o777, 0o640);
        assert_eq!(std::fs::read_link(dst.join("link")).unwrap(), outside);
        assert_eq!(m("sparse").len(), 1 << 20);
        assert!(
            m("sparse").blocks() < 64,
            "holes stay holes: {}",
            m("sparse").blocks()
        );
        assert!(from_outside(&dst).is_empty());
        // A second copy into the same directory: refused, not merged.
        let e = copy_tree(&roots.locate(&src).unwrap(), &roots.locate(&dst).unwrap()).unwrap_err();
        assert!(matches!(e, CopyError::Exists { .. }), "{e}");
    }

    #[test]
    fn a_device_node_is_refused() {
        let (_dir, roots, src, dst, _) = setup();
        // /dev/null's numbers (1, 3).
        rustix::fs::mknodat(
            rustix::fs::CWD,
            src.join("sub/null"),
            FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            rustix::fs::makedev(1, 3),
        )
        .unwrap();
        let e = copy_tree(&roots.locate(&src).unwrap(), &roots.locate(&dst).unwrap()).unwrap_err();
        assert!(matches!(e, CopyError::Device { .. }), "{e}");
        assert!(e.to_string().contains("sub/null is a device node"), "{e}");
    }

    /// The swap `cp -a` falls for, at the worst moment: a directory is exchanged with a
    /// symlink to the outside directory just before the walk opens it, and again just after
    /// it has opened it (while its files are copied). Nothing from outside is copied: the
    /// first time the symlink itself is copied, the second the directory is read through its
    /// handle, wherever it now is.
    #[test]
    fn a_directory_swapped_for_a_symlink_during_the_walk_copies_nothing_from_outside() {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        let (_dir, roots, src, dst, outside) = setup();
        let swap = src.join("swap");
        std::os::unix::fs::symlink(&outside, &swap).unwrap();
        let (sub, sw) = (src.join("sub"), swap.clone());
        let mut swaps = 0;
        let mut hook = |p: &Path| {
            // Before "sub" is opened, and before its 11th file is opened.
            if p == Path::new("sub") || p == Path::new("sub/f10") {
                renameat_with(CWD, &sub, CWD, &sw, RenameFlags::EXCHANGE).unwrap();
                swaps += 1;
            }
        };
        let got = copy_with(
            &roots.locate(&src).unwrap(),
            &roots.locate(&dst).unwrap(),
            &mut hook,
        )
        .unwrap();
        assert!(swaps >= 1);
        assert!(from_outside(&dst).is_empty(), "{:?}", from_outside(&dst));
        assert!(
            std::fs::symlink_metadata(dst.join("sub"))
                .unwrap()
                .is_symlink()
                || std::fs::symlink_metadata(dst.join("swap"))
                    .unwrap()
                    .is_symlink()
        );
        assert!(got.files >= 1, "{got:?}");
    }

    /// The same with a thread exchanging the directory and the symlink as fast as it can
    /// while the tree is copied, many times: never a file from outside.
    #[test]
    fn a_racing_swapper_never_gets_a_file_from_outside_copied() {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let (_dir, roots, src, dst, outside) = setup();
        let swap = src.join("swap");
        std::os::unix::fs::symlink(&outside, &swap).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let swaps = Arc::new(AtomicUsize::new(0));
        let t = {
            let (a, b, stop, swaps) = (src.join("sub"), swap.clone(), stop.clone(), swaps.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if renameat_with(CWD, &a, CWD, &b, RenameFlags::EXCHANGE).is_ok() {
                        swaps.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let mut outside_files = 0;
        for i in 0..60 {
            let d = dst.with_file_name(format!("dst{i}"));
            std::fs::create_dir(&d).unwrap();
            copy_tree(&roots.locate(&src).unwrap(), &roots.locate(&d).unwrap()).unwrap();
            outside_files += from_outside(&d).len();
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        assert!(swaps.load(Ordering::Relaxed) > 0);
        assert_eq!(outside_files, 0);
    }

    #[test]
    fn a_source_or_destination_through_a_symlink_is_refused() {
        let (_dir, roots, src, dst, _) = setup();
        let e = copy_tree(
            &roots.locate(&src.join("link")).unwrap(),
            &roots.locate(&dst).unwrap(),
        )
        .unwrap_err();
        assert!(
            matches!(e, CopyError::Beneath(BeneathError::Symlink { .. })),
            "{e}"
        );
        let e = copy_tree(
            &roots.locate(&src).unwrap(),
            &roots.locate(&src.join("link")).unwrap(),
        )
        .unwrap_err();
        assert!(
            matches!(e, CopyError::Beneath(BeneathError::Symlink { .. })),
            "{e}"
        );
    }
}
