//! Decides this node's placeholder host volumes: every ready volume this node serves has
//! one (registered in Nomad at its mount target, so the scheduler can place allocations
//! that request it here), and no other volume has one. Nothing is decided before the
//! node's placeholders have been listed once.

use crate::agent::effect::Effect;
use crate::agent::retry::{Work, STEP_RETRY};
use crate::executor::PlaceholderError;
use crate::nomad::NomadError;
use crate::retry::Retries;
use crate::volume::{VolumeKey, VolumeRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

/// This node's placeholders (volume → host volume ID) and the calls in flight.
#[derive(Debug, Default)]
pub(crate) struct Placeholders {
    ids: BTreeMap<VolumeKey, String>,
    loaded: bool,
    listing: bool,
    busy: BTreeSet<VolumeKey>,
}

impl Placeholders {
    /// The host volume ID of `volume`'s placeholder.
    pub(crate) fn id(&self, volume: &VolumeKey) -> Option<&String> {
        self.ids.get(volume)
    }

    pub(crate) fn contains(&self, volume: &VolumeKey) -> bool {
        self.ids.contains_key(volume)
    }

    /// A listing of this node's placeholders, when none is known yet or in flight.
    pub(crate) fn list(&mut self) -> Option<Effect> {
        if self.loaded || self.listing {
            return None;
        }
        self.listing = true;
        Some(Effect::ListPlaceholders)
    }

    pub(crate) fn on_listed(&mut self, result: Result<BTreeMap<VolumeKey, String>, NomadError>) {
        self.listing = false;
        match result {
            Ok(map) => {
                self.ids = map;
                self.loaded = true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list this node's placeholder host volumes; retrying")
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
            if self.ids.contains_key(key) || self.busy.contains(key) || !retries.ready(&work, now) {
                continue;
            }
            self.busy.insert(key.clone());
            out.push(Effect::RegisterPlaceholder {
                volume: Box::new((*rec).clone()),
                target: target.clone(),
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
        let work = Work::Placeholder(volume.clone());
        match result {
            Ok(Some(id)) => {
                tracing::info!(%volume, host_volume_id = %id, "placeholder host volume registered");
                retries.succeeded(&work);
                self.ids.insert(volume, id);
            }
            Ok(None) => {
                tracing::info!(%volume, "placeholder host volume deregistered");
                retries.succeeded(&work);
                self.ids.remove(&volume);
            }
            Err(e) => {
                tracing::warn!(%volume, error = %e, "placeholder host volume change failed; will retry");
                retries.failed(&work, STEP_RETRY, now);
            }
        }
    }
}
