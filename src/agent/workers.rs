//! Decides which volume creates and deletes this node runs: a `pending` volume whose
//! plugin is here is taken (a check-and-set write on its record decides between nodes);
//! this node's own interrupted `creating` is resumed; a `deleting` volume is deleted unless
//! it is still published here or still has a placeholder here (never delete from under a
//! mount). Another node winning the record is not a failure worth a warning.

use crate::agent::effect::Effect;
use crate::agent::executor::WorkerError;
use crate::agent::retry::{Work, STEP_RETRY};
use crate::nomad::retry::Retries;
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use std::collections::BTreeSet;
use std::time::Instant;

/// Creates and deletes in flight.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    busy: BTreeSet<VolumeKey>,
}

/// True when this node (`node_id`) should run a create or delete of `rec` now.
pub(crate) fn wants_work(rec: &VolumeRecord, node_id: &str) -> bool {
    match rec.state {
        VolumeState::Pending => true,
        VolumeState::Creating => rec.worker_node == node_id,
        VolumeState::Deleting => rec.worker_node.is_empty() || rec.worker_node == node_id,
        _ => false,
    }
}

impl Workers {
    /// Creates and deletes to start among `served` (volumes whose plugin is here).
    /// `in_use` says whether a volume is still published or has a placeholder here.
    pub(crate) fn drive<'a>(
        &mut self,
        served: impl Iterator<Item = &'a VolumeRecord>,
        node_id: &str,
        in_use: impl Fn(&VolumeKey) -> bool,
        retries: &Retries<Work>,
        now: Instant,
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        for rec in served.filter(|r| wants_work(r, node_id)) {
            let key = rec.key();
            if self.busy.contains(&key) || !retries.ready(&Work::Worker(key.clone()), now) {
                continue;
            }
            if rec.state == VolumeState::Deleting && in_use(&key) {
                continue;
            }
            self.busy.insert(key);
            out.push(if rec.state == VolumeState::Deleting {
                Effect::Delete(Box::new(rec.clone()))
            } else {
                Effect::Create(Box::new(rec.clone()))
            });
        }
        out
    }

    /// A create or delete finished; a failure waits before the next attempt.
    pub(crate) fn on_done(
        &mut self,
        volume: VolumeKey,
        result: Result<(), WorkerError>,
        retries: &mut Retries<Work>,
        now: Instant,
    ) {
        self.busy.remove(&volume);
        let work = Work::Worker(volume.clone());
        match result {
            Ok(()) => retries.succeeded(&work),
            Err(WorkerError::TakenByOther) => {
                tracing::debug!(%volume, "another node took the create/delete first");
                retries.failed(&work, STEP_RETRY, now);
            }
            Err(e) => {
                tracing::warn!(%volume, error = %e, "volume create/delete step failed");
                retries.failed(&work, STEP_RETRY, now);
            }
        }
    }
}
