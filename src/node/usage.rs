//! Usage of a mounted filesystem, read from the kernel by `statfs` (bytes and inodes), each
//! call on a thread of its own and bounded by a timeout: `statfs` on a hung FUSE or NFS
//! mount blocks in the kernel, so a reading that does not answer in time is reported as
//! hung while its thread waits on alone, and that target is not read again until the kernel
//! answers (never more than one `statfs` out per target). A dead mount (ENOTCONN, ESTALE) is
//! reported as such, never as "empty".

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A filesystem's figures, in kubelet's terms (`pkg/volume/util/fs/fs.go`, `Info`): bytes
/// and inodes, as `statfs` gives them for the whole filesystem the target is on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Size of the filesystem, bytes (`f_blocks × f_frsize`).
    pub capacity_bytes: u64,
    /// Bytes in use (`(f_blocks − f_bfree) × f_frsize`).
    pub used_bytes: u64,
    /// Bytes an unprivileged writer may still use (`f_bavail × f_frsize`).
    pub available_bytes: u64,
    /// Inodes in all (`f_files`; 0 on filesystems without a fixed inode count).
    pub inodes: u64,
    /// Inodes in use (`f_files − f_ffree`).
    pub inodes_used: u64,
    /// Free inodes (`f_ffree`).
    pub inodes_free: u64,
}

impl Usage {
    /// The figures of one `statvfs` answer.
    // The field types are the C library's (`fsblkcnt_t`, `c_ulong`): u32 on some targets.
    #[allow(clippy::unnecessary_cast)]
    pub fn of(s: &nix::sys::statvfs::Statvfs) -> Self {
        let frsize = s.fragment_size() as u64;
        let blocks = s.blocks() as u64;
        let bfree = s.blocks_free() as u64;
        let files = s.files() as u64;
        let ffree = s.files_free() as u64;
        Self {
            capacity_bytes: blocks.saturating_mul(frsize),
            used_bytes: blocks.saturating_sub(bfree).saturating_mul(frsize),
            available_bytes: (s.blocks_available() as u64).saturating_mul(frsize),
            inodes: files,
            inodes_used: files.saturating_sub(ffree),
            inodes_free: ffree,
        }
    }
}

/// Why a volume is abnormal, in the classes of Kubernetes' volume condition (KEP 1432 and
/// its 1.37 classes `Inaccessible`, `Degraded`, `DataLoss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConditionClass {
    /// The mount does not answer, or its server (a FUSE process, an NFS server) is gone.
    Inaccessible,
    /// It answers, but its storage says it is not well (a degraded array, a slow remote).
    Degraded,
    /// Its data is damaged (a filesystem check found damage it could not repair).
    DataLoss,
}

/// A published volume's condition, in the shape of CSI's `VolumeCondition` (`abnormal`,
/// `message`) plus a class: healthy when `abnormal` is false.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Condition {
    /// True when the volume is not healthy.
    pub abnormal: bool,
    /// Why, by class; `None` when healthy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<ConditionClass>,
    /// What was found (the kernel's or the plugin's words); empty when healthy.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl Condition {
    /// Abnormal, of `class`, because of `message`.
    pub fn abnormal(class: ConditionClass, message: impl Into<String>) -> Self {
        Self {
            abnormal: true,
            class: Some(class),
            message: message.into(),
        }
    }

    /// The condition one reading shows: healthy when `statfs` answered; inaccessible when
    /// the mount is dead, fails or does not answer.
    pub fn of(r: &Reading) -> Self {
        match r {
            Reading::Usage(_) => Self::default(),
            Reading::Dead(e) => Self::abnormal(
                ConditionClass::Inaccessible,
                format!("the mount's server is gone: {e}"),
            ),
            Reading::Failing(e) => {
                Self::abnormal(ConditionClass::Inaccessible, format!("statfs failed: {e}"))
            }
            Reading::Hung(after) => Self::abnormal(
                ConditionClass::Inaccessible,
                format!("statfs did not answer within {}s", after.as_secs()),
            ),
        }
    }

    /// `healthy`, or the class alone (`inaccessible`, `degraded`, `data-loss`).
    pub fn class_word(&self) -> String {
        match (self.abnormal, self.class) {
            (false, _) => "healthy".into(),
            (true, Some(c)) => serde_json::to_value(c)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            (true, None) => "abnormal".into(),
        }
    }

    /// The word `volume status` shows: `healthy`, or `abnormal (<class>)`.
    pub fn word(&self) -> String {
        match (self.abnormal, self.class) {
            (false, _) => "healthy".into(),
            (true, Some(c)) => format!(
                "abnormal ({})",
                serde_json::to_value(c)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            ),
            (true, None) => "abnormal".into(),
        }
    }
}

/// What one reading of a target found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reading {
    /// `statfs` answered.
    Usage(Usage),
    /// The mount's server is gone (ENOTCONN, ESTALE): it will not answer again.
    Dead(String),
    /// Another error (EIO, EACCES, …).
    Failing(String),
    /// `statfs` did not answer within the timeout, or an earlier one of the same target is
    /// still out (how long it has been out).
    Hung(Duration),
}

/// The `statfs` readings of one agent. Clones share the targets still out.
#[derive(Clone, Default)]
pub struct UsageReader {
    /// Targets whose `statfs` has not answered yet, with when it started.
    out: Arc<Mutex<HashMap<PathBuf, Instant>>>,
}

impl UsageReader {
    /// Reads `target` by `statfs` on a thread of its own; [`Reading::Hung`] when it does not
    /// answer within `timeout`, or at once while an earlier reading of `target` is out.
    pub async fn read(&self, target: PathBuf, timeout: Duration) -> Reading {
        let p = target.clone();
        self.read_with(target, timeout, move || {
            nix::sys::statvfs::statvfs(&p).map(|s| Usage::of(&s))
        })
        .await
    }

    /// Targets whose `statfs` is still out (a hung mount's thread waits in the kernel).
    pub fn outstanding(&self) -> usize {
        self.out.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// [`UsageReader::read`] with the blocking work given (tests hang it at will).
    pub(crate) async fn read_with(
        &self,
        target: PathBuf,
        timeout: Duration,
        work: impl FnOnce() -> nix::Result<Usage> + Send + 'static,
    ) -> Reading {
        {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(since) = out.get(&target) {
                return Reading::Hung(since.elapsed());
            }
            out.insert(target.clone(), Instant::now());
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let out = self.out.clone();
        let key = target.clone();
        let spawned = std::thread::Builder::new()
            .name("dhv-statfs".into())
            .spawn(move || {
                let r = work();
                out.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            self.forget(&target);
            return Reading::Failing(format!("cannot start a statfs thread: {e}"));
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => Reading::Hung(timeout),
            Ok(Err(_)) => Reading::Failing("the statfs thread ended without an answer".into()),
            Ok(Ok(Ok(u))) => Reading::Usage(u),
            Ok(Ok(Err(e))) => classify(e),
        }
    }

    fn forget(&self, target: &Path) {
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(target);
    }
}

fn classify(e: nix::errno::Errno) -> Reading {
    match e {
        nix::errno::Errno::ENOTCONN | nix::errno::Errno::ESTALE => Reading::Dead(e.to_string()),
        _ => Reading::Failing(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_directory_reads_its_filesystems_figures() {
        let dir = tempfile::tempdir().unwrap();
        let r = UsageReader::default()
            .read(dir.path().to_path_buf(), Duration::from_secs(30))
            .await;
        let Reading::Usage(u) = r else {
            panic!("{r:?}")
        };
        assert!(u.capacity_bytes > 0, "{u:?}");
        assert!(u.used_bytes <= u.capacity_bytes, "{u:?}");
        assert!(u.available_bytes <= u.capacity_bytes, "{u:?}");
        assert_eq!(u.inodes, u.inodes_used + u.inodes_free, "{u:?}");
    }

    #[tokio::test]
    async fn a_dead_mount_is_dead_and_a_missing_one_failing() {
        let r = UsageReader::default();
        let dead = r
            .read_with("/x".into(), Duration::from_secs(5), || {
                Err(nix::errno::Errno::ENOTCONN)
            })
            .await;
        assert!(
            matches!(dead, Reading::Dead(ref m) if m.contains("not connected")),
            "{dead:?}"
        );
        let gone = r
            .read(
                "/nonexistent/dhv-binder/usage".into(),
                Duration::from_secs(5),
            )
            .await;
        assert!(matches!(gone, Reading::Failing(_)), "{gone:?}");
    }

    /// A hung `statfs` is reported at its timeout, its target is not read again while it
    /// is out (no second thread), and another target reads at once beside it.
    #[tokio::test]
    async fn a_hung_target_is_read_once_and_never_stalls_another() {
        let r = UsageReader::default();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let s = started.clone();
        let first = r
            .read_with("/hung".into(), Duration::from_millis(200), move || {
                s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = held.recv();
                Ok(Usage::default())
            })
            .await;
        assert_eq!(first, Reading::Hung(Duration::from_millis(200)));
        let s = started.clone();
        let again = r
            .read_with("/hung".into(), Duration::from_secs(5), move || {
                s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(Usage::default())
            })
            .await;
        assert!(matches!(again, Reading::Hung(_)), "{again:?}");
        assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(r.outstanding(), 1);
        let dir = tempfile::tempdir().unwrap();
        let other = r
            .read(dir.path().to_path_buf(), Duration::from_secs(30))
            .await;
        assert!(matches!(other, Reading::Usage(_)), "{other:?}");
        release.send(()).unwrap();
        for _ in 0..200 {
            if r.outstanding() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(r.outstanding(), 0, "the hung thread gave its target back");
    }
}
