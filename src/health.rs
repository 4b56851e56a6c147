//! Health of published mounts: each published target is probed with a `stat` bounded by a
//! timeout (a hung FUSE server cannot block the agent). A mount whose server died answers
//! ENOTCONN ("transport endpoint is not connected", B14) or ESTALE: it is reported (status,
//! log), lazily unmounted so that the plan publishes it again, and once it is published and
//! answering again the allocations that used it are restarted through the Nomad API, so
//! their tasks get a fresh bind of the new mount instead of writing into a dead one.
//!
//! This module is the kernel side (the probe, the detach); what to do about a probe's
//! outcome is decided by the agent core (`agent/mount_health.rs`).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// What one probe of a mount found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// `stat` answered.
    Healthy,
    /// The mount's server is gone (ENOTCONN, ESTALE): it will never answer again.
    Dead(String),
    /// Another error (EIO, EACCES, …): reported, not acted on.
    Failing(String),
    /// `stat` did not answer within the timeout (a hung server): reported, not acted on.
    Hung(Duration),
}

/// Stats `path` on a blocking thread, giving up after `timeout`. A hung `stat` keeps its
/// thread until the kernel answers; the monitor never probes that target again meanwhile.
pub async fn probe(path: PathBuf, timeout: Duration) -> Probe {
    let work = tokio::task::spawn_blocking(move || std::fs::metadata(&path).map(|_| ()));
    match tokio::time::timeout(timeout, work).await {
        Err(_) => Probe::Hung(timeout),
        Ok(Err(e)) => Probe::Failing(format!("probe thread failed: {e}")),
        Ok(Ok(Ok(()))) => Probe::Healthy,
        Ok(Ok(Err(e))) => classify(&e),
    }
}

fn classify(e: &std::io::Error) -> Probe {
    match e.raw_os_error().map(nix::errno::Errno::from_raw) {
        Some(nix::errno::Errno::ENOTCONN) | Some(nix::errno::Errno::ESTALE) => {
            Probe::Dead(e.to_string())
        }
        _ => Probe::Failing(e.to_string()),
    }
}

/// Detaches a dead mount (`umount -l`): never blocks on the dead server.
pub fn lazy_unmount(target: &Path) -> Result<(), nix::Error> {
    nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enotconn_and_estale_are_dead_others_are_reported() {
        let e = std::io::Error::from_raw_os_error(nix::errno::Errno::ENOTCONN as i32);
        assert!(matches!(classify(&e), Probe::Dead(m) if m.contains("not connected")));
        let e = std::io::Error::from_raw_os_error(nix::errno::Errno::ESTALE as i32);
        assert!(matches!(classify(&e), Probe::Dead(_)));
        let e = std::io::Error::from_raw_os_error(nix::errno::Errno::EIO as i32);
        assert!(matches!(classify(&e), Probe::Failing(_)));
    }

    #[tokio::test]
    async fn a_probe_answers_for_a_live_path() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            probe(dir.path().to_path_buf(), Duration::from_secs(5)).await,
            Probe::Healthy
        );
    }
}
