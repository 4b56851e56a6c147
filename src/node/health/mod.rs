//! Health of published mounts: each published target is probed with a `stat` bounded by a
//! timeout (a hung FUSE server cannot block the agent). A mount whose server died answers
//! ENOTCONN ("transport endpoint is not connected", B14) or ESTALE: it is reported (status,
//! log), lazily unmounted so that the plan publishes it again, and once it is published and
//! answering again the allocations that used it are restarted through the Nomad API, so
//! their tasks get a fresh bind of the new mount instead of writing into a dead one.
//!
//! This module is the kernel side (the probe, the detach); what to do about a probe's
//! outcome is decided by the agent core (`agent/mount_health.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

mod threads;
use threads::ProbeThreads;

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

/// How many probes may wait for an answer at once on the probe threads ([`threads`]). Every
/// published mount is probed each interval; without a bound a round of 400 mounts started
/// 400 blocking threads at once (170 seen alive), each with its own allocator arena.
pub const PROBE_THREADS: usize = 4;

/// The mount probes of one agent: at most [`PROBE_THREADS`] stats waited for at once, and at
/// most one stat in flight per target. A stat that does not answer within its timeout gives
/// its permit back (the probe answers [`Probe::Hung`]) but keeps its thread until the kernel
/// answers; meanwhile that target is not stat'ed again (its probes answer `Hung` at once,
/// with how long the stat has been out). So hung mounts never starve the probes of the
/// others (a dead mount among hung ones is still found dead), and the threads are bounded
/// by [`PROBE_THREADS`] plus one per hung mount (threads beyond [`PROBE_THREADS`] end after
/// a few idle seconds). Clones share the permits, the threads and the targets.
#[derive(Clone)]
pub struct Prober {
    permits: Arc<Semaphore>,
    /// The threads the stats run on ([`threads`]).
    threads: ProbeThreads,
    /// Targets whose stat is still out, with when it started.
    out: Arc<Mutex<HashMap<PathBuf, Instant>>>,
}

impl Default for Prober {
    fn default() -> Self {
        Self::new(PROBE_THREADS)
    }
}

impl Prober {
    /// A prober with `threads` permits.
    pub fn new(threads: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(threads)),
            threads: ProbeThreads::new(threads),
            out: Arc::default(),
        }
    }

    /// Stats `path` on a probe thread; [`Probe::Hung`] when it does not answer within
    /// `timeout` (the wait for a permit, at most `timeout` per probe ahead, is not counted),
    /// or at once while an earlier stat of `path` is still out.
    pub async fn probe(&self, path: PathBuf, timeout: Duration) -> Probe {
        let p = path.clone();
        self.probe_with(path, timeout, move || std::fs::metadata(&p).map(|_| ()))
            .await
    }

    /// [`Prober::probe`] with the blocking work given (tests count threads with it).
    async fn probe_with(
        &self,
        path: PathBuf,
        timeout: Duration,
        work: impl FnOnce() -> std::io::Result<()> + Send + 'static,
    ) -> Probe {
        if let Some(since) = self.out_since(&path) {
            return Probe::Hung(since.elapsed());
        }
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return Probe::Failing("the probe permits are closed".into());
        };
        if let Some(since) = self.out_since(&path) {
            return Probe::Hung(since.elapsed());
        }
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(path.clone(), Instant::now());
        let out = self.out.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let key = path.clone();
        let started = self.threads.run(Box::new(move || {
            let r = work();
            out.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
            Box::new(move || {
                let _ = tx.send(r);
            })
        }));
        if let Err(e) = started {
            self.out
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&path);
            return Probe::Failing(format!("cannot start a probe thread: {e}"));
        }
        let answer = tokio::time::timeout(timeout, rx).await;
        drop(permit);
        match answer {
            Err(_) => Probe::Hung(timeout),
            Ok(Err(_)) => Probe::Failing("the probe thread failed".into()),
            Ok(Ok(Ok(()))) => Probe::Healthy,
            Ok(Ok(Err(e))) => classify(&e),
        }
    }

    fn out_since(&self, path: &Path) -> Option<Instant> {
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(path)
            .copied()
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
            Prober::default()
                .probe(dir.path().to_path_buf(), Duration::from_secs(5))
                .await,
            Probe::Healthy
        );
    }

    /// Issue 10: a round of probes of many mounts runs at most `PROBE_THREADS` stats at
    /// once (it started one blocking thread per mount), on as many threads (issue 50: on
    /// tokio's blocking pool it started 20 to 26 a round).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_of_probes_runs_a_bounded_number_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let prober = Prober::default();
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut round = tokio::task::JoinSet::new();
        for i in 0..40 {
            let (running, most, prober) = (running.clone(), most.clone(), prober.clone());
            round.spawn(async move {
                prober
                    .probe_with(
                        PathBuf::from(format!("/t/{i}")),
                        Duration::from_secs(60),
                        move || {
                            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(20));
                            running.fetch_sub(1, Ordering::SeqCst);
                            Ok(())
                        },
                    )
                    .await
            });
        }
        while let Some(p) = round.join_next().await {
            assert_eq!(p.unwrap(), Probe::Healthy);
        }
        let most = most.load(Ordering::SeqCst);
        assert!(
            (1..=PROBE_THREADS).contains(&most),
            "{most} probes ran at once"
        );
        // Each probe ran on a thread of the round's: none was started for a probe handed
        // over while the thread that had just answered was not yet waiting.
        let threads = prober.threads.threads();
        assert!(
            (1..=PROBE_THREADS).contains(&threads),
            "{threads} threads for {PROBE_THREADS} probes at once"
        );
    }

    /// Issue 36: hung stats (as many as there are permits) do not starve the probes of
    /// other mounts: a dead mount among them is still found dead. A hung target is not
    /// stat'ed again (no second thread) until its stat returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hung_probes_do_not_starve_the_others() {
        let prober = Prober::new(2);
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let hung = Arc::new(Mutex::new(hung));
        let threads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for round in 0..3 {
            for i in 0..4 {
                let (hung, threads) = (hung.clone(), threads.clone());
                let p = prober
                    .probe_with(
                        PathBuf::from(format!("/hung/{i}")),
                        Duration::from_millis(50),
                        move || {
                            threads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            let _ = hung.lock().unwrap().recv();
                            Ok(())
                        },
                    )
                    .await;
                assert!(matches!(p, Probe::Hung(_)), "round {round}: {p:?}");
            }
            let dead = prober
                .probe_with(PathBuf::from("/dead"), Duration::from_millis(50), || {
                    Err(std::io::Error::from_raw_os_error(
                        nix::errno::Errno::ENOTCONN as i32,
                    ))
                })
                .await;
            assert!(matches!(dead, Probe::Dead(_)), "round {round}: {dead:?}");
        }
        assert_eq!(
            threads.load(std::sync::atomic::Ordering::SeqCst),
            4,
            "a hung target was stat'ed again while its stat was out"
        );
        assert_eq!(prober.out.lock().unwrap().len(), 4);
        drop(release);
    }
}
