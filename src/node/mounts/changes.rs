//! Notice of mount-table changes: the kernel marks a mountinfo file's descriptor with
//! `POLLPRI | POLLERR` after any mount or unmount in that namespace (proc(5), "mountinfo"),
//! so the table is read again only when it changed.

use super::{MountTable, MountsError};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A watch on one mount namespace's table. Each [`MountChanges::next`] returns a table read
/// after the last change it saw; changes that happen while it reads wake the next call.
pub struct MountChanges {
    path: PathBuf,
    fd: AsyncFd<File>,
}

impl MountChanges {
    /// Watches the host's table (pid 1's mount namespace).
    pub fn host() -> Result<Self, MountsError> {
        Self::open(Path::new(super::HOST_MOUNTINFO))
    }

    /// Watches the mountinfo file at `path`. Needs a tokio runtime.
    pub fn open(path: &Path) -> Result<Self, MountsError> {
        let watch = |source| MountsError::Watch {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(|source| MountsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        // Sound: the `File` owns its descriptor and `AsyncFd` owns the `File`, so the
        // descriptor is neither closed nor replaced while registered (the I/O-safety
        // concern of tokio PR 8587). Its replacement is `unsafe`, which this crate forbids.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(file, Interest::PRIORITY).map_err(watch)?;
        Ok(Self {
            path: path.to_path_buf(),
            fd,
        })
    }

    /// The table as it is now, read through the watched descriptor.
    pub fn read(&mut self) -> Result<MountTable, MountsError> {
        let read = |source| MountsError::Read {
            path: self.path.clone(),
            source,
        };
        let file = self.fd.get_mut();
        file.seek(SeekFrom::Start(0)).map_err(read)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(read)?;
        MountTable::parse(&bytes, &self.path)
    }

    /// Waits until the table changed since the last call (or since [`MountChanges::open`]),
    /// then returns it, read afresh.
    pub async fn next(&mut self) -> Result<MountTable, MountsError> {
        let mut guard =
            self.fd
                .ready(Interest::PRIORITY)
                .await
                .map_err(|source| MountsError::Watch {
                    path: self.path.clone(),
                    source,
                })?;
        guard.clear_ready();
        drop(guard);
        self.read()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::mounts::scratch::Scratch;
    use std::time::Duration;

    #[tokio::test]
    async fn a_mount_and_an_unmount_each_wake_the_watch() {
        let s = Scratch::new();
        let mut changes = MountChanges::host().unwrap();
        let initial = changes.read().unwrap();
        let target = s.path().join("t");
        assert!(!initial.contains(&target));
        // Other tests mount beside this one: a wake-up may come from theirs, but every
        // table read after this test's own change shows it.
        s.tmpfs("t");
        let seen = tokio::time::timeout(Duration::from_secs(30), changes.next())
            .await
            .expect("a mount wakes the watch")
            .unwrap();
        assert!(seen.contains(&target));

        nix::mount::umount(&target).unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(30), changes.next())
            .await
            .expect("an unmount wakes the watch")
            .unwrap();
        assert!(!seen.contains(&target));
    }
}
