//! The host's table, read again only when the kernel says it changed. A mountinfo file's
//! descriptor is marked `POLLPRI | POLLERR` once any mount, unmount, move, propagated mount
//! or mount-flag change has been made in its namespace since the descriptor last polled
//! (proc(5), "mountinfo"; Linux `fs/proc_namespace.c`, `mounts_poll`, which compares the
//! namespace's event counter with the one the descriptor saw). So a table read through the
//! descriptor after a poll stays the current table until a later poll says otherwise, and a
//! caller that polls and sees no change gets the same answer a new read would give, without
//! the kernel formatting and the agent parsing every line again (about 1 ms for 420 mounts:
//! docs/scale.md). The agent reads the host's table after every plugin call, before every
//! unpublish and on its ticks; a wave of unpublishes reads it twice per call, and one of the
//! two now comes at no cost when no other call changed the table in between.
//!
//! What the kernel does not signal: a rename of a directory above a mount point (or inside a
//! bind's source) changes the mount point or root the table shows without a namespace
//! event, and a change of propagation type (a field the agent does not read) raises none.
//! A table is therefore reused for at most [`MAX_AGE`] after its read, then read again
//! whatever the poll says.

use super::{MountTable, MountsError};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsFd;
use std::path::Path;
#[cfg(test)]
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a table read is reused while the kernel reports no change (see the module's
/// doc: what no event signals).
pub const MAX_AGE: Duration = Duration::from_secs(2);

/// How long the agent's periodic reading (its tick, every 2 s) reuses a table while the
/// kernel reports no change: what no event signals (a rename above a mount point, by root,
/// in the agent's own placeholder tree) is noticed within this time, or at once by any
/// reading for a plugin call or an unpublish ([`MAX_AGE`]). Reading 1,000 mounts on every
/// tick was a quarter of an idle agent's CPU (docs/scale.md).
pub const IDLE_MAX_AGE: Duration = Duration::from_secs(10);

/// One namespace's table, kept with the descriptor it was read through. Every call of
/// [`Unchanged::current`] on one cache names the same file.
pub struct Unchanged {
    state: Mutex<State>,
}

struct State {
    file: Option<File>,
    /// The last table read through `file`, and when that read began.
    table: Option<(MountTable, Instant)>,
    /// Reads made (tests and the agent's metrics count them).
    reads: u64,
    /// Bytes of the last read: the next read's buffer starts at about this size, so it is
    /// not grown and copied as the reading comes in (the kernel gives a seq_file about 4 KiB
    /// per `read` call whatever the buffer's size).
    last_len: usize,
}

impl Default for Unchanged {
    fn default() -> Self {
        Self::new()
    }
}

impl Unchanged {
    /// An empty cache (the file is opened at the first [`Unchanged::current`]).
    pub const fn new() -> Self {
        Self {
            state: Mutex::new(State {
                file: None,
                table: None,
                reads: 0,
                last_len: 0,
            }),
        }
    }

    /// The table as it is now: the last one read when the descriptor reports no change
    /// since and it is younger than [`MAX_AGE`], else read afresh through the descriptor
    /// (opened again after any error). Errors: the file cannot be opened, polled or read,
    /// or a line does not parse ([`MountsError`]); an error is never answered with an
    /// older table, and the next call opens the file again.
    pub fn current(&self, path: &Path) -> Result<MountTable, MountsError> {
        self.current_within(path, MAX_AGE)
    }

    /// Like [`Unchanged::current`], reusing an unchanged table younger than `max_age`.
    pub fn current_within(
        &self,
        path: &Path,
        max_age: Duration,
    ) -> Result<MountTable, MountsError> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let read_err = |source| MountsError::Read {
            path: path.to_path_buf(),
            source,
        };
        if s.file.is_none() {
            // Opening takes the namespace's event counter as seen: the read below shows
            // every change made before it, and the next poll reports any made after.
            s.table = None;
            s.file = Some(File::open(path).map_err(read_err)?);
        }
        let changed = match s.file.as_ref() {
            Some(f) => changed(f),
            None => Ok(true),
        };
        match (&changed, &s.table) {
            (Ok(false), Some((table, read_at))) if read_at.elapsed() < max_age => {
                return Ok(table.clone());
            }
            _ => {}
        }
        s.table = None;
        let started = Instant::now();
        let size = s.last_len + s.last_len / 4 + 4096;
        let read = changed.map_err(read_err).and_then(|_| {
            let f = s.file.as_mut().ok_or_else(|| {
                read_err(std::io::Error::other(
                    "the mountinfo descriptor is not open",
                ))
            })?;
            f.seek(SeekFrom::Start(0)).map_err(read_err)?;
            let mut bytes = Vec::with_capacity(size);
            f.read_to_end(&mut bytes).map_err(read_err)?;
            MountTable::parse(&bytes, path).map(|t| (t, bytes.len()))
        });
        s.reads += 1;
        match read {
            Ok((table, len)) => {
                s.last_len = len;
                s.table = Some((table.clone(), started));
                Ok(table)
            }
            Err(e) => {
                s.file = None;
                Err(e)
            }
        }
    }

    /// How many times the file was read (not answered from the last read).
    pub fn reads(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).reads
    }
}

/// Whether the namespace's table changed since the descriptor last polled (and takes the
/// notice: the next poll reports only later changes). `poll(2)` with no wait.
fn changed(f: &File) -> std::io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(f.as_fd(), PollFlags::POLLPRI)];
    loop {
        match poll(&mut fds, PollTimeout::ZERO) {
            // A signal (a plugin's SIGCHLD) can interrupt even a poll that does not wait.
            Err(nix::errno::Errno::EINTR) => continue,
            r => {
                r.map_err(std::io::Error::from)?;
                break;
            }
        }
    }
    // Only POLLPRI is asked for: a change shows as POLLPRI | POLLERR, no change as no
    // events at all. Events the kernel could not tell (none) count as a change.
    Ok(fds[0].revents().is_none_or(|r| {
        r.intersects(
            PollFlags::POLLPRI | PollFlags::POLLERR | PollFlags::POLLNVAL | PollFlags::POLLHUP,
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread of its own in a new, private mount namespace, so that no other
    /// test's mounts change the table it reads (`unshare(CLONE_NEWNS)` moves the calling
    /// thread only), and without the copies of other tests' mounts (a copy held for the
    /// seconds these tests wait kept another test's loop device busy).
    fn in_own_namespace(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            use nix::mount::{mount, MsFlags};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
                .expect("unshare(CLONE_NEWNS): the tests run as root");
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .expect("make the test's namespace private");
            crate::node::mounts::scratch::drop_foreign_mounts_here();
            f()
        })
        .join()
        .expect("the test's thread");
    }

    #[test]
    fn a_table_is_read_again_only_after_a_change() {
        in_own_namespace(|| {
            let dir = tempfile::tempdir().unwrap();
            let target = dir.path().join("t");
            std::fs::create_dir(&target).unwrap();
            let path = PathBuf::from(format!(
                "/proc/{}/task/{}/mountinfo",
                std::process::id(),
                nix::unistd::gettid()
            ));
            // As in `a_table_older_than_its_age_is_read_again`: a second descriptor
            // witnesses any event the test did not make (a full `cargo test` run once saw
            // one in the test's own namespace); a step that must not read again is
            // checked only when the witness saw no event during it.
            for attempt in 1..=3 {
                let witness = File::open(&path).unwrap();
                let cache = Unchanged::new();
                let first = cache.current(&path).unwrap();
                assert!(!first.contains(&target));
                // Nothing changed: the same table, not read again.
                let again = cache.current(&path).unwrap();
                if changed(&witness).unwrap() {
                    eprintln!("attempt {attempt}: the namespace changed before the mount");
                    continue;
                }
                assert_eq!(cache.reads(), 1);
                assert_eq!(format!("{first:?}"), format!("{again:?}"));
                // A mount is seen by the very next call.
                nix::mount::mount(
                    Some("tmpfs"),
                    &target,
                    Some("tmpfs"),
                    nix::mount::MsFlags::empty(),
                    None::<&str>,
                )
                .unwrap();
                assert!(cache.current(&path).unwrap().contains(&target));
                assert_eq!(cache.reads(), 2);
                changed(&witness).unwrap();
                assert!(cache.current(&path).unwrap().contains(&target));
                if changed(&witness).unwrap() {
                    eprintln!("attempt {attempt}: the namespace changed after the mount");
                    nix::mount::umount(&target).unwrap();
                    continue;
                }
                assert_eq!(cache.reads(), 2);
                // A change of the mount's flags too.
                nix::mount::mount(
                    None::<&str>,
                    &target,
                    None::<&str>,
                    nix::mount::MsFlags::MS_REMOUNT
                        | nix::mount::MsFlags::MS_BIND
                        | nix::mount::MsFlags::MS_RDONLY,
                    None::<&str>,
                )
                .unwrap();
                let ro = cache.current(&path).unwrap();
                assert!(ro.top_at(&target).unwrap().read_only());
                assert_eq!(cache.reads(), 3);
                // And an unmount.
                nix::mount::umount(&target).unwrap();
                assert!(!cache.current(&path).unwrap().contains(&target));
                assert_eq!(cache.reads(), 4);
                return;
            }
            panic!("the test's namespace changed in each of 3 attempts");
        });
    }

    #[test]
    fn a_table_older_than_its_age_is_read_again() {
        in_own_namespace(|| {
            let path = PathBuf::from(format!(
                "/proc/{}/task/{}/mountinfo",
                std::process::id(),
                nix::unistd::gettid()
            ));
            // The namespace is the test's own, yet a CI run once saw an event in it during
            // the wait that the test did not make (the cache then rightly read again). A
            // second descriptor, opened before the cache's, witnesses any such event: a
            // wait it saw no event in must end with the same table.
            for attempt in 1..=3 {
                let witness = File::open(&path).unwrap();
                let cache = Unchanged::new();
                cache.current(&path).unwrap();
                cache.current(&path).unwrap();
                // A reading that allows an older table takes the same one...
                std::thread::sleep(MAX_AGE + Duration::from_millis(50));
                cache.current_within(&path, IDLE_MAX_AGE).unwrap();
                if changed(&witness).unwrap() {
                    eprintln!("attempt {attempt}: the namespace changed during the wait");
                    continue;
                }
                assert_eq!(cache.reads(), 1);
                // ...which is past the age of every other reading.
                cache.current(&path).unwrap();
                assert_eq!(cache.reads(), 2);
                cache.current_within(&path, Duration::ZERO).unwrap();
                assert_eq!(cache.reads(), 3, "a zero age reads every time");
                return;
            }
            panic!("the test's namespace changed during each of 3 waits");
        });
    }

    #[test]
    fn an_unreadable_file_is_an_error_every_time() {
        let path = PathBuf::from("/proc/self/no-such-mountinfo");
        let cache = Unchanged::new();
        assert!(cache.current(&path).is_err());
        assert!(cache.current(&path).is_err());
    }
}
