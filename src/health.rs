//! Health of published mounts: each published target is probed with a `stat` bounded by a
//! timeout (a hung FUSE server cannot block the agent). A mount whose server died answers
//! ENOTCONN ("transport endpoint is not connected", B14) or ESTALE: it is reported (status,
//! log), lazily unmounted so that the plan publishes it again, and once it is published and
//! answering again the allocations that used it are restarted through the Nomad API, so
//! their tasks get a fresh bind of the new mount instead of writing into a dead one.
//!
//! The monitor only decides; the agent owns the journal and runs what it returns.

use crate::journal::{MountRecord, MountState, UserKey};
use crate::nomad::Client;
use crate::volume::VolumeKey;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio::time::Instant;

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

/// A probe's outcome, or a restart's, sent back to the agent.
#[derive(Debug)]
pub enum Report {
    Probed {
        volume: VolumeKey,
        target: PathBuf,
        probe: Probe,
    },
    Restarted {
        volume: VolumeKey,
        alloc_id: String,
        result: Result<(), String>,
    },
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

/// One broken mount, as reported in `dhv-binder status`.
#[derive(Debug, Clone, Serialize)]
pub struct Broken {
    pub target: PathBuf,
    pub error: String,
    /// Seconds since the Unix epoch when it was found.
    pub since: u64,
    /// "republishing", "restarting allocations", or "failing" / "hung" (reported only).
    pub action: String,
    /// The allocations that used the dead mount, restarted once it is published again.
    pub allocations: Vec<String>,
}

/// What the agent must do after a probe.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    Nothing,
    /// Detach the dead mount now; the plan then publishes it again.
    Unmount(PathBuf),
    /// The mount is published again: restart these allocations.
    Restart(Vec<String>),
}

/// The health monitor's state, owned by the agent.
pub struct Monitor {
    interval: Duration,
    timeout: Duration,
    last: Option<Instant>,
    probing: BTreeSet<VolumeKey>,
    broken: BTreeMap<VolumeKey, Broken>,
    restarting: BTreeSet<(VolumeKey, String)>,
    /// The last dead mounts that were republished, newest last.
    recovered: std::collections::VecDeque<(VolumeKey, Broken)>,
    tx: mpsc::UnboundedSender<Report>,
    rx: Option<mpsc::UnboundedReceiver<Report>>,
}

impl Monitor {
    /// Probes every `interval`, each `stat` bounded by `timeout`.
    pub fn new(interval: Duration, timeout: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            interval,
            timeout,
            last: None,
            probing: BTreeSet::new(),
            broken: BTreeMap::new(),
            restarting: BTreeSet::new(),
            recovered: Default::default(),
            tx,
            rx: Some(rx),
        }
    }

    /// The receiver of probe and restart reports (taken once, by the agent's loop).
    pub fn take_reports(&mut self) -> mpsc::UnboundedReceiver<Report> {
        self.rx.take().expect("reports taken once")
    }

    /// Starts probes of published, mounted targets when one interval has passed. Mounts in
    /// a plugin call (`busy`) are left alone.
    pub fn tick(
        &mut self,
        mounts: &BTreeMap<VolumeKey, MountRecord>,
        mounted: &BTreeSet<PathBuf>,
        busy: &BTreeSet<VolumeKey>,
    ) {
        if self.last.is_some_and(|t| t.elapsed() < self.interval) {
            return;
        }
        self.last = Some(Instant::now());
        // Forget what is no longer published here (unpublished, or gone from the journal).
        self.broken.retain(|k, _| mounts.contains_key(k));
        for (key, m) in mounts {
            let due = m.state == MountState::Published
                && mounted.contains(&m.target)
                && !busy.contains(key)
                && !self.probing.contains(key);
            if !due {
                continue;
            }
            self.probing.insert(key.clone());
            let (tx, volume, target, timeout) =
                (self.tx.clone(), key.clone(), m.target.clone(), self.timeout);
            tokio::spawn(async move {
                let probe = probe(target.clone(), timeout).await;
                let _ = tx.send(Report::Probed {
                    volume,
                    target,
                    probe,
                });
            });
        }
    }

    /// Records a probe's outcome and says what to do; nothing while the volume is `busy`
    /// in a plugin call. `users` are the journal's user
    /// records (which allocations use which volume).
    pub fn on_probe(
        &mut self,
        volume: &VolumeKey,
        target: &Path,
        probe: Probe,
        busy: bool,
        users: &BTreeSet<UserKey>,
    ) -> Action {
        self.probing.remove(volume);
        if busy {
            // A publish or unpublish started meanwhile: its result is the newer truth.
            return Action::Nothing;
        }
        let allocs = || -> Vec<String> {
            users
                .iter()
                .filter(|u| &u.volume == volume)
                .map(|u| u.alloc_id.clone())
                .collect()
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        match probe {
            Probe::Healthy => match self.broken.get_mut(volume) {
                Some(b) if b.action == "republishing" && b.allocations.is_empty() => {
                    tracing::info!(%volume, target = %target.display(), "the dead mount is published again");
                    self.resolve(volume);
                    Action::Nothing
                }
                Some(b) if b.action == "republishing" => {
                    tracing::info!(%volume, target = %target.display(), allocations = ?b.allocations, "the dead mount is published again; restarting the allocations that used it");
                    b.action = "restarting allocations".into();
                    Action::Restart(b.allocations.clone())
                }
                Some(b) if b.action == "restarting allocations" => Action::Nothing,
                Some(_) => {
                    tracing::info!(%volume, target = %target.display(), "mount answers again");
                    self.broken.remove(volume);
                    Action::Nothing
                }
                None => Action::Nothing,
            },
            Probe::Dead(error) => {
                let allocations = allocs();
                tracing::error!(%volume, target = %target.display(), %error, ?allocations, "published mount is dead (its server is gone); detaching it to publish it again");
                self.broken.insert(
                    volume.clone(),
                    Broken {
                        target: target.to_path_buf(),
                        error,
                        since: now,
                        action: "republishing".into(),
                        allocations,
                    },
                );
                Action::Unmount(target.to_path_buf())
            }
            Probe::Failing(error) => {
                tracing::warn!(%volume, target = %target.display(), %error, "published mount fails its probe");
                self.report_only(volume, target, error, "failing", now, allocs());
                Action::Nothing
            }
            Probe::Hung(after) => {
                let error = format!("stat did not answer within {after:?}");
                tracing::warn!(%volume, target = %target.display(), %error, "published mount does not answer");
                self.report_only(volume, target, error, "hung", now, allocs());
                Action::Nothing
            }
        }
    }

    fn report_only(
        &mut self,
        volume: &VolumeKey,
        target: &Path,
        error: String,
        action: &str,
        now: u64,
        allocations: Vec<String>,
    ) {
        // A mount being republished keeps that state until it answers.
        if self
            .broken
            .get(volume)
            .is_some_and(|b| b.action == "republishing")
        {
            return;
        }
        let since = self.broken.get(volume).map(|b| b.since).unwrap_or(now);
        self.broken.insert(
            volume.clone(),
            Broken {
                target: target.to_path_buf(),
                error,
                since,
                action: action.into(),
                allocations,
            },
        );
    }

    /// Starts the restarts of `allocs` (running tasks only: prestart already ran and the
    /// mount is back, so the main tasks only need a fresh bind of it).
    pub fn restart(&mut self, client: &Client, volume: &VolumeKey, allocs: Vec<String>) {
        for alloc_id in allocs {
            if !self.restarting.insert((volume.clone(), alloc_id.clone())) {
                continue;
            }
            let (tx, client, volume) = (self.tx.clone(), client.clone(), volume.clone());
            tokio::spawn(async move {
                let result = client
                    .restart_allocation(&alloc_id, false)
                    .await
                    .map_err(|e| e.to_string());
                let _ = tx.send(Report::Restarted {
                    volume,
                    alloc_id,
                    result,
                });
            });
        }
    }

    /// Records a restart's outcome. A failed restart is retried at the next probe.
    pub fn on_restarted(&mut self, volume: &VolumeKey, alloc_id: &str, result: Result<(), String>) {
        self.restarting
            .remove(&(volume.clone(), alloc_id.to_string()));
        let Some(b) = self.broken.get_mut(volume) else {
            return;
        };
        match result {
            Ok(()) => {
                tracing::info!(%volume, %alloc_id, "allocation restarted onto the republished mount");
                b.allocations.retain(|a| a != alloc_id);
                if b.allocations.is_empty() {
                    self.resolve(volume);
                }
            }
            Err(e) => {
                tracing::warn!(%volume, %alloc_id, error = %e, "cannot restart the allocation; trying again");
                b.action = "republishing".into();
                b.error = format!("restart of allocation {alloc_id} failed: {e}");
            }
        }
    }

    fn resolve(&mut self, volume: &VolumeKey) {
        if let Some(mut b) = self.broken.remove(volume) {
            b.action = "recovered".into();
            self.recovered.push_back((volume.clone(), b));
            if self.recovered.len() > 20 {
                self.recovered.pop_front();
            }
        }
    }

    /// The broken mounts, for `dhv-binder status`.
    pub fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "interval_ms": self.interval.as_millis() as u64,
            "broken": self.broken.iter().map(|(k, b)| (k.to_string(), b)).collect::<BTreeMap<_, _>>(),
            "recovered": self.recovered.iter().map(|(k, b)| serde_json::json!({"volume": k.to_string(), "target": b.target, "error": b.error, "since": b.since})).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: "data".into(),
        }
    }

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

    #[tokio::test]
    async fn dead_mount_is_unmounted_then_its_users_restarted_once_it_answers() {
        let mut m = Monitor::new(Duration::from_secs(1), Duration::from_secs(1));
        let t = PathBuf::from("/mnt/x");
        let users: BTreeSet<UserKey> = ["a1", "a2"]
            .iter()
            .map(|a| UserKey {
                alloc_id: a.to_string(),
                volume: key(),
            })
            .collect();
        assert_eq!(
            m.on_probe(&key(), &t, Probe::Dead("ENOTCONN".into()), false, &users),
            Action::Unmount(t.clone())
        );
        assert_eq!(
            m.status()["broken"]["default/data"]["action"],
            "republishing"
        );
        // While publishing again, a hung or failing probe does not hide the state.
        m.on_probe(
            &key(),
            &t,
            Probe::Hung(Duration::from_secs(1)),
            false,
            &users,
        );
        assert_eq!(
            m.status()["broken"]["default/data"]["action"],
            "republishing"
        );
        assert_eq!(
            m.on_probe(&key(), &t, Probe::Healthy, false, &users),
            Action::Restart(vec!["a1".into(), "a2".into()])
        );
        assert_eq!(
            m.on_probe(&key(), &t, Probe::Healthy, false, &users),
            Action::Nothing
        );
        m.on_restarted(&key(), "a1", Ok(()));
        m.on_restarted(&key(), "a2", Err("403".into()));
        assert_eq!(
            m.status()["broken"]["default/data"]["action"],
            "republishing"
        );
        assert_eq!(
            m.on_probe(&key(), &t, Probe::Healthy, false, &users),
            Action::Restart(vec!["a2".into()])
        );
        m.on_restarted(&key(), "a2", Ok(()));
        assert!(m.status()["broken"].as_object().unwrap().is_empty());
        assert_eq!(m.status()["recovered"][0]["volume"], "default/data");
    }
}
