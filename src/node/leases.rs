//! The claims' last renewals that succeeded, kept across an agent restart on the same boot.
//!
//! A claim's lease ends `2 x TTL + lock delay` after this node *sent* its last acquire or
//! renewal that succeeded (`crate::agent::claims`). After a restart the agent knows the
//! claims it held (the journal) but not when their leases end, so a claim whose first renewal
//! fails was fenced at once, killing its tasks on an agent upgrade during a short outage of
//! the servers. This file keeps, per claim, when its last successful renewal was sent, on
//! `CLOCK_BOOTTIME` (which counts a suspend), with the boot it was measured in
//! (`/proc/sys/kernel/random/boot_id`). After a restart on the same boot the lease end is
//! known again; after a reboot, or with a file that is missing or cannot be read, it is
//! not, and a claim whose first renewal fails is fenced at once, as before.
//!
//! **Why no `fsync`.** The file is written with a write and a rename and never synced. Only
//! a restart of the agent on the same boot reads it, and that reads the page cache, which
//! holds what was last written whether or not it reached the disk; a machine that crashed
//! has a new boot ID, and the file is ignored. A write is at most once a second
//! ([`WRITE_EVERY`]), on a thread of its own, so a slow state disk never delays a renewal.
//! A stale file only understates a lease (an older sending), never overstates it.
//!
//! Shape (`<state_dir>/leases.json`, JSON, mode 0600):
//! `{"boot_id": "<uuid>", "claims": [{"namespace": "default", "name": "db",
//! "lock_id": "<id>", "sent_boottime_ns": 123456789}]}`.

use crate::volume::VolumeKey;
use nix::time::{clock_gettime, ClockId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The file's name in the state directory.
pub const FILE_NAME: &str = "leases.json";

/// The least time between two writes of the file.
pub const WRITE_EVERY: Duration = Duration::from_secs(1);

/// At most this many claims are read back (a node holds far fewer; a larger file is not
/// this agent's).
const MAX_CLAIMS: usize = 100_000;

/// At most this many bytes are read back.
const MAX_BYTES: u64 = 64 << 20;

/// Why the file was not written or not used (logged; the claims then fall back to an
/// unknown lease).
#[derive(Debug, thiserror::Error)]
pub enum LeaseFileError {
    /// An I/O error on the file or the boot ID.
    #[error("{what} {path}: {source}; claims restored after a restart are fenced at their first failed renewal until this is fixed")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not in the shape above.
    #[error("{path} is not a lease file ({reason}); it is ignored and rewritten")]
    Malformed { path: PathBuf, reason: String },
    /// `CLOCK_BOOTTIME` could not be read.
    #[error("cannot read CLOCK_BOOTTIME: {0}")]
    Clock(nix::Error),
}

/// One claim's last renewal that succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    namespace: String,
    name: String,
    lock_id: String,
    /// When the renewal was sent, on `CLOCK_BOOTTIME`, in nanoseconds.
    sent_boottime_ns: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Contents {
    boot_id: String,
    claims: Vec<Entry>,
}

/// Reads the kernel's boot ID and `CLOCK_BOOTTIME` (a trait so tests can pose as another
/// boot or a later moment).
pub trait BootSource: Send + Sync {
    /// `/proc/sys/kernel/random/boot_id`, trimmed.
    fn boot_id(&self) -> Result<String, LeaseFileError>;
    /// `CLOCK_BOOTTIME` now.
    fn boottime(&self) -> Result<Duration, LeaseFileError>;
}

/// The kernel's boot ID and clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelBoot;

const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

impl BootSource for KernelBoot {
    fn boot_id(&self) -> Result<String, LeaseFileError> {
        let id = std::fs::read_to_string(BOOT_ID).map_err(|source| LeaseFileError::Io {
            what: "cannot read",
            path: BOOT_ID.into(),
            source,
        })?;
        Ok(id.trim().to_string())
    }

    fn boottime(&self) -> Result<Duration, LeaseFileError> {
        clock_gettime(ClockId::CLOCK_BOOTTIME)
            .map(Duration::from)
            .map_err(LeaseFileError::Clock)
    }
}

/// The lease file of one state directory.
pub struct LeaseFile<B: BootSource = KernelBoot> {
    path: PathBuf,
    boot: B,
}

impl LeaseFile<KernelBoot> {
    /// The file `<state_dir>/leases.json`.
    pub fn new(state_dir: &Path) -> Self {
        Self::with_boot(state_dir, KernelBoot)
    }
}

impl<B: BootSource> LeaseFile<B> {
    /// The file in `state_dir`, read against `boot`.
    pub fn with_boot(state_dir: &Path, boot: B) -> Self {
        Self {
            path: state_dir.join(FILE_NAME),
            boot,
        }
    }

    /// Writes the claims' last successful renewals, each given as (volume, lock ID, how long
    /// ago it was sent). Write and rename, no `fsync` (see the module documentation).
    pub fn write<'a>(
        &self,
        claims: impl IntoIterator<Item = (&'a VolumeKey, &'a str, Duration)>,
    ) -> Result<(), LeaseFileError> {
        let now = self.boot.boottime()?;
        let claims = claims
            .into_iter()
            .filter_map(|(k, lock_id, age)| {
                let sent = now.checked_sub(age)?;
                Some(Entry {
                    namespace: k.namespace.to_string(),
                    name: k.name.to_string(),
                    lock_id: lock_id.to_string(),
                    sent_boottime_ns: u64::try_from(sent.as_nanos()).ok()?,
                })
            })
            .collect();
        let contents = Contents {
            boot_id: self.boot.boot_id()?,
            claims,
        };
        let bytes = serde_json::to_vec(&contents).map_err(|e| LeaseFileError::Malformed {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        let tmp = self.path.with_extension("json.tmp");
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| LeaseFileError::Io { what, path, source }
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io("cannot create", &tmp))?;
        f.write_all(&bytes).map_err(io("cannot write", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, &self.path).map_err(io("cannot rename onto", &self.path))
    }

    /// The claims' last successful renewals written on this boot: volume → (lock ID, how
    /// long ago it was sent). Empty when there is no file; an error when it cannot be read,
    /// is malformed or was written on another boot is logged by the caller and means the
    /// same. Entries sent "in the future" are dropped.
    pub fn read(&self) -> Result<BTreeMap<VolumeKey, (String, Duration)>, LeaseFileError> {
        let f = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(source) => {
                return Err(LeaseFileError::Io {
                    what: "cannot open",
                    path: self.path.clone(),
                    source,
                })
            }
        };
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_BYTES), &mut bytes).map_err(
            |source| LeaseFileError::Io {
                what: "cannot read",
                path: self.path.clone(),
                source,
            },
        )?;
        let malformed = |reason: String| LeaseFileError::Malformed {
            path: self.path.clone(),
            reason,
        };
        let contents: Contents =
            serde_json::from_slice(&bytes).map_err(|e| malformed(e.to_string()))?;
        if contents.claims.len() > MAX_CLAIMS {
            return Err(malformed(format!(
                "{} claims, more than {MAX_CLAIMS}",
                contents.claims.len()
            )));
        }
        if contents.boot_id != self.boot.boot_id()? {
            // Written before a reboot: how long the node was down is unknown.
            return Ok(BTreeMap::new());
        }
        let now = self.boot.boottime()?;
        Ok(contents
            .claims
            .into_iter()
            .filter_map(|e| {
                let age = now.checked_sub(Duration::from_nanos(e.sent_boottime_ns))?;
                let key = VolumeKey {
                    namespace: e.namespace.into(),
                    name: e.name.into(),
                };
                key.relative_path().ok()?;
                Some((key, (e.lock_id, age)))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[derive(Clone)]
    struct Fake {
        id: Arc<std::sync::Mutex<String>>,
        now_ns: Arc<AtomicU64>,
    }

    impl BootSource for Fake {
        fn boot_id(&self) -> Result<String, LeaseFileError> {
            Ok(self.id.lock().unwrap().clone())
        }
        fn boottime(&self) -> Result<Duration, LeaseFileError> {
            Ok(Duration::from_nanos(self.now_ns.load(Ordering::SeqCst)))
        }
    }

    fn fake() -> Fake {
        Fake {
            id: Arc::new(std::sync::Mutex::new("boot-a".into())),
            now_ns: Arc::new(AtomicU64::new(100_000_000_000)),
        }
    }

    fn key(name: &str) -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: name.into(),
        }
    }

    #[test]
    fn a_restart_on_the_same_boot_reads_how_long_ago_each_renewal_was_sent() {
        let dir = tempfile::tempdir().unwrap();
        let boot = fake();
        let f = LeaseFile::with_boot(dir.path(), boot.clone());
        let (db, logs) = (key("db"), key("logs"));
        f.write([
            (&db, "lock-1", Duration::from_secs(3)),
            (&logs, "lock-2", Duration::from_secs(0)),
        ])
        .unwrap();
        // The agent restarts 7 s later (the boot clock kept counting).
        boot.now_ns.fetch_add(7_000_000_000, Ordering::SeqCst);
        let read = f.read().unwrap();
        assert_eq!(read[&db], ("lock-1".into(), Duration::from_secs(10)));
        assert_eq!(read[&logs], ("lock-2".into(), Duration::from_secs(7)));
        let mode = std::fs::metadata(dir.path().join(FILE_NAME))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }

    #[test]
    fn a_file_of_another_boot_says_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let boot = fake();
        let f = LeaseFile::with_boot(dir.path(), boot.clone());
        f.write([(&key("db"), "lock-1", Duration::from_secs(1))])
            .unwrap();
        *boot.id.lock().unwrap() = "boot-b".into();
        // After a reboot CLOCK_BOOTTIME starts again from zero.
        boot.now_ns.store(5_000_000_000, Ordering::SeqCst);
        assert!(f.read().unwrap().is_empty());
    }

    #[test]
    fn no_file_says_nothing_and_a_malformed_or_odd_one_is_refused_or_filtered() {
        let dir = tempfile::tempdir().unwrap();
        let f = LeaseFile::with_boot(dir.path(), fake());
        assert!(f.read().unwrap().is_empty());
        std::fs::write(dir.path().join(FILE_NAME), b"{\"boot_id\": 3").unwrap();
        assert!(matches!(f.read(), Err(LeaseFileError::Malformed { .. })));
        // An entry sent after "now", and one whose name could not be a volume's: dropped.
        std::fs::write(
            dir.path().join(FILE_NAME),
            br#"{"boot_id":"boot-a","claims":[
                {"namespace":"default","name":"db","lock_id":"l","sent_boottime_ns":200000000000},
                {"namespace":"default","name":"../x","lock_id":"l","sent_boottime_ns":1},
                {"namespace":"default","name":"ok","lock_id":"l","sent_boottime_ns":99000000000}]}"#,
        )
        .unwrap();
        let read = f.read().unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[&key("ok")], ("l".into(), Duration::from_secs(1)));
    }
}
