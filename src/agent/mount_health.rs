//! Decides what a mount probe means (docs/architecture.md, "health of published mounts"):
//! a dead mount (ENOTCONN, ESTALE: its server is gone, B14) is detached so that the plan
//! publishes it again, and once it answers again the allocations that used it are
//! restarted onto the new mount; a failing or hung mount is reported, not acted on.
//! Probes run every `interval`; none while a plugin call on the volume is in flight.
//! A restart that fails is tried again at a later probe round, after a backoff
//! ([`STEP_RETRY`] from the round's time: in effect 10, 10, 10, 10, 20, 40 s, then every
//! 60 s), logged at most once a minute with a count and counted
//! (`dhv_binder_nomad_retries_total{call="allocation_restart"}`).

use crate::agent::effect::Effect;
use crate::agent::retry::STEP_RETRY;
use crate::node::health::Probe;
use crate::node::journal::{MountState, UserKey};
use crate::nomad::retry::{Call, FailureLog, Retries, LOG_EVERY};
use crate::volume::VolumeKey;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where a broken mount stands (`dhv-binder status`, `mount_health.broken.*.action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum Phase {
    /// Dead and detached: the plan publishes it again.
    #[serde(rename = "republishing")]
    Republishing,
    /// Published again: its allocations are being restarted onto it.
    #[serde(rename = "restarting allocations")]
    RestartingAllocations,
    /// The probe fails with another error (reported only).
    #[serde(rename = "failing")]
    Failing,
    /// The probe did not answer in time (reported only).
    #[serde(rename = "hung")]
    Hung,
    /// Republished and its allocations restarted (history).
    #[serde(rename = "recovered")]
    Recovered,
}

/// One broken mount, as reported in `dhv-binder status`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Broken {
    pub target: PathBuf,
    pub error: String,
    /// Seconds since the Unix epoch when it was found.
    pub since: u64,
    pub action: Phase,
    /// The allocations that used the dead mount, restarted once it is published again.
    pub allocations: Vec<String>,
}

/// The mount health state, owned by the core.
#[derive(Debug)]
pub(crate) struct MountHealth {
    interval: Duration,
    last: Option<Instant>,
    probing: BTreeSet<VolumeKey>,
    broken: BTreeMap<VolumeKey, Broken>,
    restarting: BTreeSet<(VolumeKey, String)>,
    /// The last dead mounts that were republished, newest last (at most 20).
    recovered: VecDeque<(VolumeKey, Broken)>,
    /// Volumes whose restart of an allocation failed: not restarted again before their
    /// backoff, counted from the probe round's time.
    restart_retry: Retries<VolumeKey>,
    restart_failures: FailureLog,
}

fn wall_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

impl MountHealth {
    /// Probes every `interval`.
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
            probing: BTreeSet::new(),
            broken: BTreeMap::new(),
            restarting: BTreeSet::new(),
            recovered: VecDeque::new(),
            restart_retry: Retries::new(0),
            restart_failures: FailureLog::new(Call::AllocationRestart, LOG_EVERY),
        }
    }

    /// When the next round of probes is due.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.last.map(|t| t + self.interval)
    }

    /// Probes of published, mounted targets once an interval has passed since the last
    /// round. Volumes in a plugin call (`busy`) are left alone.
    pub(crate) fn tick(
        &mut self,
        now: Instant,
        mounts: &crate::node::journal::Mounts,
        mounted: &BTreeSet<PathBuf>,
        busy: &BTreeSet<VolumeKey>,
    ) -> Vec<Effect> {
        if self.last.is_some_and(|t| now < t + self.interval) {
            return Vec::new();
        }
        self.last = Some(now);
        // Forget what is no longer published here (unpublished, or gone from the journal).
        self.broken.retain(|k, _| mounts.contains_key(k));
        let mut out = Vec::new();
        for (key, m) in mounts {
            let due = m.state == MountState::Published
                && mounted.contains(&m.target)
                && !busy.contains(key)
                && !self.probing.contains(key);
            if due {
                self.probing.insert(key.clone());
                out.push(Effect::Probe {
                    volume: key.clone(),
                    target: m.target.clone(),
                });
            }
        }
        out
    }

    /// Records a probe's outcome and returns what to do; nothing while the volume is
    /// `busy` in a plugin call (its result is the newer truth). `users` are the journal's
    /// user records (which allocations use which volume).
    pub(crate) fn on_probe(
        &mut self,
        volume: &VolumeKey,
        target: &Path,
        probe: Probe,
        busy: bool,
        users: &BTreeSet<UserKey>,
    ) -> Vec<Effect> {
        self.probing.remove(volume);
        if busy {
            return Vec::new();
        }
        let allocs = || -> Vec<String> {
            users
                .iter()
                .filter(|u| &u.volume == volume)
                .map(|u| u.alloc_id.to_string())
                .collect()
        };
        let now = wall_secs();
        match probe {
            Probe::Healthy => match self.broken.get_mut(volume) {
                Some(b) if b.action == Phase::Republishing && b.allocations.is_empty() => {
                    tracing::info!(%volume, target = %target.display(), "the dead mount is published again");
                    self.resolve(volume);
                    Vec::new()
                }
                Some(b)
                    if b.action == Phase::Republishing
                        && self
                            .last
                            .is_some_and(|t| !self.restart_retry.ready(volume, t)) =>
                {
                    Vec::new()
                }
                Some(b) if b.action == Phase::Republishing => {
                    tracing::info!(%volume, target = %target.display(), allocations = ?b.allocations, "the dead mount is published again; restarting the allocations that used it");
                    b.action = Phase::RestartingAllocations;
                    let allocs = b.allocations.clone();
                    self.restart(volume, allocs)
                }
                Some(b) if b.action == Phase::RestartingAllocations => Vec::new(),
                Some(_) => {
                    tracing::info!(%volume, target = %target.display(), "mount answers again");
                    self.broken.remove(volume);
                    Vec::new()
                }
                None => Vec::new(),
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
                        action: Phase::Republishing,
                        allocations,
                    },
                );
                vec![Effect::Detach {
                    volume: volume.clone(),
                    target: target.to_path_buf(),
                }]
            }
            Probe::Failing(error) => {
                tracing::warn!(%volume, target = %target.display(), %error, "published mount fails its probe");
                self.report_only(volume, target, error, Phase::Failing, now, allocs());
                Vec::new()
            }
            Probe::Hung(after) => {
                let error = format!("stat did not answer within {after:?}");
                tracing::warn!(%volume, target = %target.display(), %error, "published mount does not answer");
                self.report_only(volume, target, error, Phase::Hung, now, allocs());
                Vec::new()
            }
        }
    }

    /// A fenced volume's claim was renewed: its mount (read-only, or its FUSE connection
    /// aborted) is detached so that the plan publishes it again, and the allocations that
    /// used it are restarted onto the new mount, as for a dead mount.
    pub(crate) fn restore_fenced(
        &mut self,
        volume: &VolumeKey,
        target: &Path,
        users: &BTreeSet<UserKey>,
    ) -> Vec<Effect> {
        let allocations: Vec<String> = users
            .iter()
            .filter(|u| &u.volume == volume)
            .map(|u| u.alloc_id.to_string())
            .collect();
        self.broken.insert(
            volume.clone(),
            Broken {
                target: target.to_path_buf(),
                error: "fenced: the claim's lease was about to end without a renewal".into(),
                since: wall_secs(),
                action: Phase::Republishing,
                allocations,
            },
        );
        vec![Effect::Detach {
            volume: volume.clone(),
            target: target.to_path_buf(),
        }]
    }

    fn report_only(
        &mut self,
        volume: &VolumeKey,
        target: &Path,
        error: String,
        action: Phase,
        now: u64,
        allocations: Vec<String>,
    ) {
        // A mount being republished keeps that state until it answers.
        if self
            .broken
            .get(volume)
            .is_some_and(|b| b.action == Phase::Republishing)
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
                action,
                allocations,
            },
        );
    }

    /// Restarts of `allocs` not already in flight (running tasks only: prestart already
    /// ran and the mount is back, so the main tasks only need a fresh bind of it).
    fn restart(&mut self, volume: &VolumeKey, allocs: Vec<String>) -> Vec<Effect> {
        allocs
            .into_iter()
            .filter(|a| self.restarting.insert((volume.clone(), a.clone())))
            .map(|alloc_id| Effect::RestartAlloc {
                volume: volume.clone(),
                alloc_id,
                task: None,
                all_tasks: false,
            })
            .collect()
    }

    /// True while `volume`'s dead or fenced mount is being published again: its users are
    /// restarted once it answers.
    pub(crate) fn republishing(&self, volume: &VolumeKey) -> bool {
        self.broken
            .get(volume)
            .is_some_and(|b| b.action == Phase::Republishing)
    }

    /// Records a restart's outcome (`error` when it failed). A failed restart is retried
    /// at the next probe.
    pub(crate) fn on_restarted(
        &mut self,
        volume: &VolumeKey,
        alloc_id: &str,
        error: Option<String>,
    ) {
        self.restarting
            .remove(&(volume.clone(), alloc_id.to_string()));
        let Some(b) = self.broken.get_mut(volume) else {
            // A restart after a first publish (an ungated allocation, `gate`).
            match error {
                None => {
                    tracing::info!(%volume, %alloc_id, "allocation restarted onto the published volume")
                }
                // `TaskRunner.Restart` (`client/allocrunner/taskrunner/lifecycle.go`):
                // `ErrTaskNotRunning`, answered 500. A pending task starts on the published
                // volume; a dead one no longer uses it.
                Some(e) if e.contains("Task not running") => {
                    tracing::info!(%volume, %alloc_id, "the ungated task is not running (Nomad: \"Task not running\"): it starts on the published volume, or has ended; nothing to restart")
                }
                Some(e) => {
                    tracing::warn!(%volume, %alloc_id, error = %e, "cannot restart the ungated allocation onto the published volume: its tasks that started before the publish keep an empty read-only directory until they restart")
                }
            }
            return;
        };
        match error {
            None => {
                tracing::info!(%volume, %alloc_id, "allocation restarted onto the republished mount");
                b.allocations.retain(|a| a != alloc_id);
                if b.allocations.is_empty() {
                    self.resolve(volume);
                }
            }
            Some(e) => {
                b.action = Phase::Republishing;
                b.error = format!("restart of allocation {alloc_id} failed: {e}");
                if let Some(now) = self.last {
                    self.restart_retry.failed(volume, STEP_RETRY, now);
                    if let Some(failures) = self.restart_failures.failed(now) {
                        tracing::warn!(%volume, %alloc_id, error = %e, failures, "cannot restart the allocation; trying again at a later probe round, after a backoff (logged at most once a minute)");
                    }
                }
            }
        }
    }

    fn resolve(&mut self, volume: &VolumeKey) {
        self.restart_retry.succeeded(volume);
        if let Some(mut b) = self.broken.remove(volume) {
            b.action = Phase::Recovered;
            self.recovered.push_back((volume.clone(), b));
            if self.recovered.len() > 20 {
                self.recovered.pop_front();
            }
        }
    }

    /// The broken mounts, for `dhv-binder status`.
    pub(crate) fn status(&self) -> serde_json::Value {
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

    fn restarts(e: &[Effect]) -> Vec<String> {
        e.iter()
            .filter_map(|e| match e {
                Effect::RestartAlloc { alloc_id, .. } => Some(alloc_id.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn dead_mount_is_detached_then_its_users_restarted_once_it_answers() {
        let mut m = MountHealth::new(Duration::from_secs(1));
        let t = PathBuf::from("/mnt/x");
        let users: BTreeSet<UserKey> = ["a1", "a2"]
            .iter()
            .map(|a| UserKey {
                alloc_id: (*a).into(),
                volume: key(),
            })
            .collect();
        let e = m.on_probe(&key(), &t, Probe::Dead("ENOTCONN".into()), false, &users);
        assert!(matches!(&e[..], [Effect::Detach { target, .. }] if target == &t));
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
        let e = m.on_probe(&key(), &t, Probe::Healthy, false, &users);
        assert_eq!(restarts(&e), vec!["a1".to_string(), "a2".into()]);
        assert!(m
            .on_probe(&key(), &t, Probe::Healthy, false, &users)
            .is_empty());
        m.on_restarted(&key(), "a1", None);
        m.on_restarted(&key(), "a2", Some("403".into()));
        assert_eq!(
            m.status()["broken"]["default/data"]["action"],
            "republishing"
        );
        let e = m.on_probe(&key(), &t, Probe::Healthy, false, &users);
        assert_eq!(restarts(&e), vec!["a2".to_string()]);
        m.on_restarted(&key(), "a2", None);
        assert!(m.status()["broken"].as_object().unwrap().is_empty());
        assert_eq!(m.status()["recovered"][0]["volume"], "default/data");
    }

    #[test]
    fn a_probe_during_a_plugin_call_decides_nothing() {
        let mut m = MountHealth::new(Duration::from_secs(1));
        let e = m.on_probe(
            &key(),
            Path::new("/mnt/x"),
            Probe::Dead("ESTALE".into()),
            true,
            &BTreeSet::new(),
        );
        assert!(e.is_empty());
        assert!(m.status()["broken"].as_object().unwrap().is_empty());
    }

    #[test]
    fn probes_run_once_per_interval_on_published_mounted_idle_volumes() {
        let mut m = MountHealth::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let mut rec = crate::node::journal::tests::rec(MountState::Published);
        rec.target = "/mnt/x".into();
        let mounts = BTreeMap::from([(key(), std::sync::Arc::new(rec))]);
        let mounted = BTreeSet::from([PathBuf::from("/mnt/x")]);
        let none = BTreeSet::new();
        assert_eq!(m.tick(t0, &mounts, &mounted, &none).len(), 1);
        assert_eq!(m.next_wakeup(), Some(t0 + Duration::from_secs(10)));
        // Not again before the interval, nor while the first probe is out.
        assert!(m
            .tick(t0 + Duration::from_secs(1), &mounts, &mounted, &none)
            .is_empty());
        assert!(m
            .tick(t0 + Duration::from_secs(10), &mounts, &mounted, &none)
            .is_empty());
        m.on_probe(
            &key(),
            Path::new("/mnt/x"),
            Probe::Healthy,
            false,
            &BTreeSet::new(),
        );
        // Busy or unmounted volumes are not probed.
        let busy = BTreeSet::from([key()]);
        assert!(m
            .tick(t0 + Duration::from_secs(20), &mounts, &mounted, &busy)
            .is_empty());
        assert!(m
            .tick(
                t0 + Duration::from_secs(30),
                &mounts,
                &BTreeSet::new(),
                &none
            )
            .is_empty());
        assert_eq!(
            m.tick(t0 + Duration::from_secs(40), &mounts, &mounted, &none)
                .len(),
            1
        );
    }

    /// Issue 45 #2: a restart that keeps failing is tried again after a growing backoff,
    /// not at every probe round: over 300 s of rounds every 10 s, 9 restarts (10, 10, 10,
    /// 10, 20, 40, 60, 60, 60 s apart) instead of 30.
    #[test]
    fn a_failing_restart_backs_off_over_probe_rounds() {
        let mut m = MountHealth::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let mut rec = crate::node::journal::tests::rec(MountState::Published);
        rec.target = "/mnt/x".into();
        let t = rec.target.clone();
        let mounts = BTreeMap::from([(key(), std::sync::Arc::new(rec))]);
        let mounted = BTreeSet::from([t.clone()]);
        let users: BTreeSet<UserKey> = BTreeSet::from([UserKey {
            alloc_id: "a1".into(),
            volume: key(),
        }]);
        m.tick(t0, &mounts, &mounted, &BTreeSet::new());
        m.on_probe(&key(), &t, Probe::Dead("ENOTCONN".into()), false, &users);
        let mut restarts = 0;
        for round in 1..=30u64 {
            let now = t0 + Duration::from_secs(10 * round);
            assert_eq!(m.tick(now, &mounts, &mounted, &BTreeSet::new()).len(), 1);
            let e = m.on_probe(&key(), &t, Probe::Healthy, false, &users);
            for alloc in self::restarts(&e) {
                restarts += 1;
                m.on_restarted(&key(), &alloc, Some("500 no cluster leader".into()));
            }
        }
        assert!((8..=10).contains(&restarts), "{restarts} restarts in 300 s");
    }
}
