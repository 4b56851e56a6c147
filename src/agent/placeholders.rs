//! Decides this node's placeholder host volumes: every ready volume this node serves has
//! one (registered in Nomad at its mount target, so the scheduler can place allocations
//! that request it here), and no other volume has one. Nothing is decided before the
//! node's placeholders have been listed once.
//!
//! The listing is repeated every [`RELIST`]: a placeholder that disappeared from Nomad
//! (deregistered by hand, lost with the node's state) is registered again, and one Nomad
//! reports `unavailable` (its node's fingerprint no longer carries it, or the node is down:
//! `nomad/state/state_store_host_volumes.go` `upsertHostVolumeForNode`) is
//! registered again with its ID, which makes the client fingerprint it anew
//! (`nomad/host_volume_endpoint.go` `Register`). A listing taken while a registration of a
//! volume was in flight or finished leaves what we know of that volume alone.

use crate::agent::effect::Effect;
use crate::agent::executor::{ListedPlaceholder, PlaceholderError};
use crate::agent::retry::{Work, STEP_RETRY};
use crate::nomad::retry::{Call, FailureLog, Retries, LOG_EVERY};
use crate::nomad::NomadError;
use crate::volume::{VolumeKey, VolumeRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How often this node's placeholders are listed again.
pub(crate) const RELIST: Duration = Duration::from_secs(60);

/// This node's placeholders (volume → host volume ID) and the calls in flight.
#[derive(Debug)]
pub(crate) struct Placeholders {
    ids: BTreeMap<VolumeKey, String>,
    /// Placeholders Nomad reports `unavailable`: registered again with their ID.
    unavailable: BTreeSet<VolumeKey>,
    loaded: bool,
    listing: bool,
    listed_at: Option<Instant>,
    /// The namespaces the listing in flight reads, and those the last good one read.
    asked: BTreeSet<String>,
    covered: BTreeSet<String>,
    busy: BTreeSet<VolumeKey>,
    /// Volumes whose registration finished while a listing was in flight: that listing
    /// may predate it and says nothing about them.
    touched: BTreeSet<VolumeKey>,
    list_log: FailureLog,
    change_log: FailureLog,
}

impl Default for Placeholders {
    fn default() -> Self {
        Self {
            ids: BTreeMap::new(),
            unavailable: BTreeSet::new(),
            loaded: false,
            listing: false,
            listed_at: None,
            asked: BTreeSet::new(),
            covered: BTreeSet::new(),
            busy: BTreeSet::new(),
            touched: BTreeSet::new(),
            list_log: FailureLog::new(Call::PlaceholderList, LOG_EVERY),
            change_log: FailureLog::new(Call::PlaceholderChange, LOG_EVERY),
        }
    }
}

impl Placeholders {
    /// The host volume ID of `volume`'s placeholder.
    pub(crate) fn id(&self, volume: &VolumeKey) -> Option<&String> {
        self.ids.get(volume)
    }

    pub(crate) fn contains(&self, volume: &VolumeKey) -> bool {
        self.ids.contains_key(volume)
    }

    /// The namespaces of the placeholders known: a listing keeps reading them (a stale one
    /// whose record went is found and deregistered).
    pub(crate) fn namespaces(&self) -> impl Iterator<Item = &str> + '_ {
        self.ids.keys().map(|k| &*k.namespace)
    }

    /// A listing of this node's placeholders in `namespaces`: when none is known yet, the
    /// last one is [`RELIST`] old, or a namespace is not covered yet; never two at once, and
    /// after a failure not before its backoff.
    pub(crate) fn list(
        &mut self,
        now: Instant,
        namespaces: BTreeSet<String>,
        retries: &Retries<Work>,
    ) -> Option<Effect> {
        let due = !self.loaded
            || !namespaces.is_subset(&self.covered)
            || self
                .listed_at
                .is_none_or(|t| now.saturating_duration_since(t) >= RELIST);
        if self.listing || !due || !retries.ready(&Work::PlaceholderList, now) {
            return None;
        }
        self.listing = true;
        self.touched.clear();
        self.asked = namespaces.clone();
        Some(Effect::ListPlaceholders { namespaces })
    }

    pub(crate) fn on_listed(
        &mut self,
        result: Result<BTreeMap<VolumeKey, ListedPlaceholder>, NomadError>,
        retries: &mut Retries<Work>,
        now: Instant,
    ) {
        self.listing = false;
        match result {
            Ok(mut map) => {
                retries.succeeded(&Work::PlaceholderList);
                let failures = self.list_log.succeeded();
                if failures > 0 {
                    tracing::info!(
                        failures,
                        "this node's placeholder host volumes are listed again"
                    );
                }
                self.covered = std::mem::take(&mut self.asked);
                // Volumes with a call in flight or finished since the listing started keep
                // what we know of them.
                for key in self.busy.iter().chain(&self.touched) {
                    map.remove(key);
                    if let Some(id) = self.ids.get(key) {
                        map.insert(
                            key.clone(),
                            ListedPlaceholder {
                                id: id.clone(),
                                available: !self.unavailable.contains(key),
                            },
                        );
                    }
                }
                if self.loaded {
                    for key in self.ids.keys().filter(|k| !map.contains_key(*k)) {
                        tracing::warn!(volume = %key, "placeholder host volume disappeared from Nomad; registering it again if still wanted");
                    }
                }
                self.unavailable = map
                    .iter()
                    .filter(|(_, l)| !l.available)
                    .map(|(k, _)| k.clone())
                    .collect();
                self.ids = map.into_iter().map(|(k, l)| (k, l.id)).collect();
                self.loaded = true;
                self.listed_at = Some(now);
            }
            Err(e) => {
                let at = retries.failed(&Work::PlaceholderList, STEP_RETRY, now);
                if let Some(failures) = self.list_log.failed(now) {
                    tracing::warn!(error = %e, failures, retry_in = ?at.saturating_duration_since(now), "cannot list this node's placeholder host volumes; retrying after a backoff (logged at most once a minute)");
                }
            }
        }
    }

    /// Registrations for `want` (the ready volumes this node serves, with their targets)
    /// that have none, and deregistrations of placeholders no longer wanted.
    pub(crate) fn drive(
        &mut self,
        want: &BTreeMap<VolumeKey, (&VolumeRecord, PathBuf)>,
        retries: &Retries<Work>,
        now: Instant,
    ) -> Vec<Effect> {
        if !self.loaded {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (key, (rec, target)) in want {
            let work = Work::Placeholder(key.clone());
            let known = self.ids.get(key);
            let again = known.is_some() && self.unavailable.contains(key);
            if (known.is_some() && !again)
                || self.busy.contains(key)
                || !retries.ready(&work, now)
                || !self.covered.contains(&*key.namespace)
            {
                continue;
            }
            if again {
                tracing::warn!(volume = %key, "placeholder host volume is unavailable in Nomad; registering it again");
            }
            self.busy.insert(key.clone());
            out.push(Effect::RegisterPlaceholder {
                volume: Box::new((*rec).clone()),
                target: target.clone(),
                id: known.filter(|_| again).cloned(),
            });
        }
        let stale: Vec<(VolumeKey, String)> = self
            .ids
            .iter()
            .filter(|(k, _)| !want.contains_key(*k))
            .map(|(k, id)| (k.clone(), id.clone()))
            .collect();
        for (key, id) in stale {
            let work = Work::Placeholder(key.clone());
            if self.busy.contains(&key) || !retries.ready(&work, now) {
                continue;
            }
            self.busy.insert(key.clone());
            out.push(Effect::DeregisterPlaceholder { volume: key, id });
        }
        out
    }

    /// A registration (`Some(id)`) or deregistration (`None`) finished.
    pub(crate) fn on_done(
        &mut self,
        volume: VolumeKey,
        result: Result<Option<String>, PlaceholderError>,
        retries: &mut Retries<Work>,
        now: Instant,
    ) {
        self.busy.remove(&volume);
        if self.listing {
            self.touched.insert(volume.clone());
        }
        let work = Work::Placeholder(volume.clone());
        match result {
            Ok(Some(id)) => {
                tracing::info!(%volume, host_volume_id = %id, "placeholder host volume registered");
                retries.succeeded(&work);
                self.unavailable.remove(&volume);
                self.ids.insert(volume, id);
            }
            Ok(None) => {
                tracing::info!(%volume, "placeholder host volume deregistered");
                retries.succeeded(&work);
                self.unavailable.remove(&volume);
                self.ids.remove(&volume);
            }
            Err(e) => {
                retries.failed(&work, STEP_RETRY, now);
                if let Some(failures) = self.change_log.failed(now) {
                    tracing::warn!(%volume, error = %e, failures, "placeholder host volume change failed; retrying after a backoff (logged at most once a minute, failures of every volume counted)");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::reconcile::tests::volume;

    fn listed(id: &str, available: bool) -> ListedPlaceholder {
        ListedPlaceholder {
            id: id.into(),
            available,
        }
    }

    fn ns() -> BTreeSet<String> {
        BTreeSet::from(["default".to_string()])
    }

    fn registrations(e: &[Effect]) -> Vec<(String, Option<String>)> {
        e.iter()
            .filter_map(|x| match x {
                Effect::RegisterPlaceholder { volume, id, .. } => {
                    Some((volume.spec.name.clone(), id.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Issue 11 #7: the placeholders are listed again every [`RELIST`]; one that
    /// disappeared is registered anew, one Nomad reports unavailable is registered again
    /// with its ID. Without the fix they were listed once, at start, and never repaired.
    #[test]
    fn relisting_repairs_a_vanished_or_unavailable_placeholder() {
        let t = Instant::now();
        let mut retries = Retries::new(1);
        let (d, e) = (
            volume("d", "single-node-writer"),
            volume("e", "single-node-writer"),
        );
        let want = BTreeMap::from([
            (d.key(), (&d, PathBuf::from("/m/default/d"))),
            (e.key(), (&e, PathBuf::from("/m/default/e"))),
        ]);
        let mut p = Placeholders::default();
        assert!(matches!(
            p.list(t, ns(), &retries),
            Some(Effect::ListPlaceholders { .. })
        ));
        assert!(p.list(t, ns(), &retries).is_none(), "one listing at a time");
        p.on_listed(
            Ok(BTreeMap::from([
                (d.key(), listed("hv-d", true)),
                (e.key(), listed("hv-e", true)),
            ])),
            &mut retries,
            t,
        );
        assert!(registrations(&p.drive(&want, &retries, t)).is_empty());
        assert!(
            p.list(t + RELIST / 2, ns(), &retries).is_none(),
            "not yet due"
        );
        let t = t + RELIST;
        assert!(p.list(t, ns(), &retries).is_some(), "due again");
        // "d" was deregistered by hand; "e" is unavailable.
        p.on_listed(
            Ok(BTreeMap::from([(e.key(), listed("hv-e", false))])),
            &mut retries,
            t,
        );
        assert_eq!(
            registrations(&p.drive(&want, &retries, t)),
            vec![
                ("d".to_string(), None),
                ("e".to_string(), Some("hv-e".to_string()))
            ]
        );
    }

    /// A listing that started before a registration finished says nothing about that
    /// volume: its new placeholder is kept, not registered twice.
    #[test]
    fn a_listing_older_than_a_registration_does_not_undo_it() {
        let t = Instant::now();
        let mut retries = Retries::new(1);
        let d = volume("d", "single-node-writer");
        let want = BTreeMap::from([(d.key(), (&d, PathBuf::from("/m/default/d")))]);
        let mut p = Placeholders::default();
        p.list(t, ns(), &retries);
        p.on_listed(Ok(BTreeMap::new()), &mut retries, t);
        assert_eq!(registrations(&p.drive(&want, &retries, t)).len(), 1);
        let t = t + RELIST;
        assert!(p.list(t, ns(), &retries).is_some());
        p.on_done(d.key(), Ok(Some("hv-d".into())), &mut retries, t);
        p.on_listed(Ok(BTreeMap::new()), &mut retries, t);
        assert_eq!(p.id(&d.key()).map(String::as_str), Some("hv-d"));
        assert!(registrations(&p.drive(&want, &retries, t)).is_empty());
    }

    /// Issue 45 #1: a volume of a namespace no listing has read yet (a record in a new
    /// namespace) is registered only after a listing of that namespace, which the new
    /// namespace makes due at once.
    #[test]
    fn a_new_namespace_is_listed_before_its_placeholders_are_registered() {
        let t = Instant::now();
        let mut retries = Retries::new(1);
        let mut p = Placeholders::default();
        p.list(t, ns(), &retries);
        p.on_listed(Ok(BTreeMap::new()), &mut retries, t);
        let mut d = volume("d", "single-node-writer");
        d.spec.namespace = "team-b".into();
        let want = BTreeMap::from([(d.key(), (&d, PathBuf::from("/m/team-b/d")))]);
        assert!(registrations(&p.drive(&want, &retries, t)).is_empty());
        let both = BTreeSet::from(["default".to_string(), "team-b".to_string()]);
        match p.list(t, both.clone(), &retries) {
            Some(Effect::ListPlaceholders { namespaces }) => assert_eq!(namespaces, both),
            other => panic!("a listing of the new namespace is due at once: {other:?}"),
        }
        p.on_listed(Ok(BTreeMap::new()), &mut retries, t);
        assert_eq!(registrations(&p.drive(&want, &retries, t)).len(), 1);
    }

    /// Issue 45 #2: a listing that fails is tried again after a growing backoff, not at
    /// every pass: over 60 s of passes every 100 ms, a handful of listings (1 s doubling,
    /// ±20 %: at about 0, 1, 3, 7, 15, 31 s) instead of one per pass. The code before listed
    /// again at every pass until one succeeded (600 here).
    #[test]
    fn a_failing_listing_backs_off() {
        let t0 = Instant::now();
        let mut retries = Retries::new(1);
        let mut p = Placeholders::default();
        let mut at = Vec::new();
        for i in 0..600u64 {
            let t = t0 + Duration::from_millis(100 * i);
            if p.list(t, ns(), &retries).is_some() {
                at.push(t - t0);
                p.on_listed(
                    Err(NomadError::NoLeader {
                        what: "list host volumes".into(),
                    }),
                    &mut retries,
                    t,
                );
            }
        }
        assert!((5..=7).contains(&at.len()), "listings at {at:?}");
        for w in at.windows(3) {
            assert!(w[2] - w[1] > w[1] - w[0], "the waits grow: {at:?}");
        }
    }
}
