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
use crate::nomad::NomadError;
use crate::retry::Retries;
use crate::volume::{VolumeKey, VolumeRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How often this node's placeholders are listed again.
pub(crate) const RELIST: Duration = Duration::from_secs(60);

/// This node's placeholders (volume → host volume ID) and the calls in flight.
#[derive(Debug, Default)]
pub(crate) struct Placeholders {
    ids: BTreeMap<VolumeKey, String>,
    /// Placeholders Nomad reports `unavailable`: registered again with their ID.
    unavailable: BTreeSet<VolumeKey>,
    loaded: bool,
    listing: bool,
    listed_at: Option<Instant>,
    busy: BTreeSet<VolumeKey>,
    /// Volumes whose registration finished while a listing was in flight: that listing
    /// may predate it and says nothing about them.
    touched: BTreeSet<VolumeKey>,
}

impl Placeholders {
    /// The host volume ID of `volume`'s placeholder.
    pub(crate) fn id(&self, volume: &VolumeKey) -> Option<&String> {
        self.ids.get(volume)
    }

    pub(crate) fn contains(&self, volume: &VolumeKey) -> bool {
        self.ids.contains_key(volume)
    }

    /// A listing of this node's placeholders: when none is known yet, or the last one is
    /// [`RELIST`] old; never two at once.
    pub(crate) fn list(&mut self, now: Instant) -> Option<Effect> {
        let due = !self.loaded
            || self
                .listed_at
                .is_none_or(|t| now.saturating_duration_since(t) >= RELIST);
        if self.listing || !due {
            return None;
        }
        self.listing = true;
        self.touched.clear();
        Some(Effect::ListPlaceholders)
    }

    pub(crate) fn on_listed(
        &mut self,
        result: Result<BTreeMap<VolumeKey, ListedPlaceholder>, NomadError>,
        now: Instant,
    ) {
        self.listing = false;
        match result {
            Ok(mut map) => {
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
                tracing::warn!(error = %e, "cannot list this node's placeholder host volumes; retrying");
                if self.loaded {
                    self.listed_at = Some(now);
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
            if (known.is_some() && !again) || self.busy.contains(key) || !retries.ready(&work, now)
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
                tracing::warn!(%volume, error = %e, "placeholder host volume change failed; will retry");
                retries.failed(&work, STEP_RETRY, now);
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
        let retries = Retries::new(1);
        let (d, e) = (
            volume("d", "single-node-writer"),
            volume("e", "single-node-writer"),
        );
        let want = BTreeMap::from([
            (d.key(), (&d, PathBuf::from("/m/default/d"))),
            (e.key(), (&e, PathBuf::from("/m/default/e"))),
        ]);
        let mut p = Placeholders::default();
        assert!(matches!(p.list(t), Some(Effect::ListPlaceholders)));
        assert!(p.list(t).is_none(), "one listing at a time");
        p.on_listed(
            Ok(BTreeMap::from([
                (d.key(), listed("hv-d", true)),
                (e.key(), listed("hv-e", true)),
            ])),
            t,
        );
        assert!(registrations(&p.drive(&want, &retries, t)).is_empty());
        assert!(p.list(t + RELIST / 2).is_none(), "not yet due");
        let t = t + RELIST;
        assert!(p.list(t).is_some(), "due again");
        // "d" was deregistered by hand; "e" is unavailable.
        p.on_listed(Ok(BTreeMap::from([(e.key(), listed("hv-e", false))])), t);
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
        p.list(t);
        p.on_listed(Ok(BTreeMap::new()), t);
        assert_eq!(registrations(&p.drive(&want, &retries, t)).len(), 1);
        let t = t + RELIST;
        assert!(p.list(t).is_some());
        p.on_done(d.key(), Ok(Some("hv-d".into())), &mut retries, t);
        p.on_listed(Ok(BTreeMap::new()), t);
        assert_eq!(p.id(&d.key()).map(String::as_str), Some("hv-d"));
        assert!(registrations(&p.drive(&want, &retries, t)).is_empty());
    }
}
