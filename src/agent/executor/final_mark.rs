//! Writes a "final" publish failure into its volume's record (by check-and-set, read again
//! on a conflict), so that every node stops offering the volume
//! ([`crate::volume::final_failure`]).

use super::Completion;
use crate::cluster::worker::{put_cas, TakeError};
use crate::nomad::Client;
use crate::volume::final_failure::FinalFailure;
use crate::volume::{record_path, VolumeKey, VolumeRecord};

/// Check-and-set attempts before the mark is left to the core's backoff.
const ATTEMPTS: usize = 5;

/// Marks the record of `volume` (only while it is still the volume `volume_id`: a record
/// deleted and created again under the name is another volume) with `failure`, unless it
/// already holds one. `Ok(Some(index))`: the record holds a failure at that ModifyIndex;
/// `Ok(None)`: the record is gone or is another volume (nothing to mark).
pub async fn mark_final(
    client: Client,
    volume: VolumeKey,
    volume_id: String,
    failure: FinalFailure,
) -> Completion {
    let result = async {
        for _ in 0..ATTEMPTS {
            let path = record_path(&volume.name);
            let Some(var) = client
                .variable(&volume.namespace, &path)
                .await
                .map_err(|e| e.to_string())?
            else {
                return Ok(None);
            };
            let mut rec = VolumeRecord::from_variable(&var).map_err(|e| e.to_string())?;
            if rec.id != volume_id {
                return Ok(None);
            }
            if rec.final_failure.is_some() {
                return Ok(Some(rec.modify_index));
            }
            rec.final_failure = Some(failure.clone());
            match put_cas(&client, &rec.to_variable(), rec.modify_index).await {
                Ok(v) => return Ok(Some(v.modify_index)),
                Err(TakeError::Lost { .. }) => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!(
            "the record of {volume} changed at each of {ATTEMPTS} check-and-set writes"
        ))
    }
    .await;
    Completion::FinalMarked { volume, result }
}
