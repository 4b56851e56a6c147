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
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

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

/// How many probes may run at once on the agent's blocking threads. Every published mount
/// is probed each interval; without a bound a round of 400 mounts started 400 blocking
/// threads at once (170 seen alive), each with its own allocator arena.
pub const PROBE_THREADS: usize = 4;

/// Stats `path` on a blocking thread, at most [`PROBE_THREADS`] of them at once (a probe
/// takes one of `permits`, shared by all probes of the agent), giving up after `timeout`,
/// which counts the wait for a permit too. A hung `stat` keeps its thread and its permit until
/// the kernel answers; the monitor never probes that target again meanwhile. While hung
/// probes hold every permit, the others answer [`Probe::Hung`] after `timeout` (reported
/// only) instead of starting more threads.
pub async fn probe(path: PathBuf, timeout: Duration, permits: Arc<Semaphore>) -> Probe {
    probe_with(timeout, permits, move || {
        std::fs::metadata(&path).map(|_| ())
    })
    .await
}

/// [`probe`] with the blocking work given (tests count threads with it).
async fn probe_with(
    timeout: Duration,
    permits: Arc<Semaphore>,
    work: impl FnOnce() -> std::io::Result<()> + Send + 'static,
) -> Probe {
    let run = async move {
        let permit = permits.acquire_owned().await;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
    };
    match tokio::time::timeout(timeout, run).await {
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
            probe(
                dir.path().to_path_buf(),
                Duration::from_secs(5),
                Arc::new(Semaphore::new(PROBE_THREADS))
            )
            .await,
            Probe::Healthy
        );
    }

    /// Issue 10: a round of probes of many mounts runs at most `PROBE_THREADS` stats at
    /// once (it started one blocking thread per mount).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_of_probes_runs_a_bounded_number_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let permits = Arc::new(Semaphore::new(PROBE_THREADS));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut round = tokio::task::JoinSet::new();
        for _ in 0..40 {
            let (running, most) = (running.clone(), most.clone());
            round.spawn(probe_with(
                Duration::from_secs(60),
                permits.clone(),
                move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                },
            ));
        }
        while let Some(p) = round.join_next().await {
            assert_eq!(p.unwrap(), Probe::Healthy);
        }
        let most = most.load(Ordering::SeqCst);
        assert!(
            (1..=PROBE_THREADS).contains(&most),
            "{most} probes ran at once"
        );
    }

    /// A hung probe keeps its permit after its timeout until the stat returns: hung mounts
    /// cannot make the agent start more threads.
    #[tokio::test]
    async fn a_hung_probe_keeps_its_permit_until_its_stat_returns() {
        let permits = Arc::new(Semaphore::new(1));
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let first = probe_with(Duration::from_millis(50), permits.clone(), move || {
            let _ = hung.recv();
            Ok(())
        })
        .await;
        assert_eq!(first, Probe::Hung(Duration::from_millis(50)));
        assert_eq!(
            permits.available_permits(),
            0,
            "the hung stat holds the permit"
        );
        release.send(()).unwrap();
        let again = permits.acquire().await.unwrap();
        drop(again);
        assert_eq!(
            probe(
                std::env::temp_dir(),
                Duration::from_secs(5),
                permits.clone()
            )
            .await,
            Probe::Healthy
        );
    }
}
