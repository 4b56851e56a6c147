//! The operator's override of a claim (`volume claim release`): a signed mark, in the
//! variable `dhv-binder/claim-releases/<name>` of the volume's namespace, that says "the
//! claim held by node N, as it stood at the claim variable's ModifyIndex I, is released by
//! the operator". It is one of the evidences for hand-over (docs/architecture.md,
//! "Fencing"): a node that finds the last holder still `ready` in Nomad with a live
//! allocation using the volume takes the claim anyway when a mark with a valid operator
//! signature names that holder and the claim's current ModifyIndex. A mark that does not
//! verify is ignored (and logged). Once another node acquires, the claim's ModifyIndex moves
//! on and the mark no longer applies to anything.
//!
//! Nomad API: `GET /v1/var/:path`, `PUT /v1/var/:path`.

use super::trust::{RecordTrust, Signed, SigningKey};
use crate::nomad::types::Variable;
use crate::nomad::{Client, NomadError};
use crate::volume::{encode_name, VolumeKey};
use std::collections::BTreeMap;

/// Variable path prefix of the release marks.
pub const RELEASE_PREFIX: &str = "dhv-binder/claim-releases/";

/// The variable path of a volume's release mark.
pub fn release_path(name: &str) -> String {
    format!("{RELEASE_PREFIX}{}", encode_name(name))
}

/// An operator's release of one node's claim on one volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseMark {
    /// The volume.
    pub volume: VolumeKey,
    /// The node whose claim is released (the claim's `node_id` item).
    pub holder: String,
    /// The claim variable's ModifyIndex when the operator released it.
    pub claim_index: u64,
    /// When the operator released it (Unix milliseconds; informational, not signed).
    pub unix_ms: u64,
    /// `ed25519:<key id>:<base64>` over the place, `holder` and `claim_index`.
    pub signature: String,
    no_delete: String,
}

impl ReleaseMark {
    /// An unsigned mark.
    pub fn new(volume: VolumeKey, holder: String, claim_index: u64, unix_ms: u64) -> Self {
        Self {
            volume,
            holder,
            claim_index,
            unix_ms,
            signature: String::new(),
            no_delete: String::new(),
        }
    }

    /// The mark as its variable.
    pub fn to_variable(&self) -> Variable {
        Variable {
            namespace: self.volume.namespace.to_string(),
            path: release_path(&self.volume.name),
            items: BTreeMap::from([
                ("holder".into(), self.holder.clone()),
                ("claim_index".into(), self.claim_index.to_string()),
                ("unix_ms".into(), self.unix_ms.to_string()),
                ("signature".into(), self.signature.clone()),
            ]),
            ..Default::default()
        }
    }

    /// Reads a mark from its variable; `None` when an item is missing or malformed.
    pub fn from_variable(volume: &VolumeKey, var: &Variable) -> Option<Self> {
        let item = |k: &str| var.items.get(k).cloned().unwrap_or_default();
        let mut m = Self::new(
            volume.clone(),
            item("holder"),
            item("claim_index").parse().ok()?,
            item("unix_ms").parse().unwrap_or(0),
        );
        m.signature = item("signature");
        Some(m)
    }

    /// Signs the mark with the operator's key.
    pub fn sign(&mut self, key: &SigningKey) {
        key.sign(self);
    }
}

impl Signed for ReleaseMark {
    fn place(&self) -> (String, String, String) {
        (
            self.volume.namespace.to_string(),
            release_path(&self.volume.name),
            self.volume.name.to_string(),
        )
    }
    fn signed_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("op", "release-claim".into()),
            ("holder", self.holder.clone().into()),
            ("claim_index", self.claim_index.into()),
        ]
    }
    fn signatures(&self) -> (&str, &str) {
        (&self.signature, &self.no_delete)
    }
    fn signatures_mut(&mut self) -> (&mut String, &mut String) {
        (&mut self.signature, &mut self.no_delete)
    }
    fn deleting(&self) -> bool {
        false
    }
}

/// Whether the operator released `holder`'s claim on `volume` at the claim's current
/// `claim_index`: a mark exists, names both, and verifies with `trust`. A mark that does not
/// verify is logged at warn and counts as no release. Nomad API: `GET /v1/var/:path`.
pub async fn released_by_operator(
    client: &Client,
    trust: &RecordTrust,
    volume: &VolumeKey,
    holder: &str,
    claim_index: u64,
) -> Result<bool, NomadError> {
    let Some(var) = client
        .variable(&volume.namespace, &release_path(&volume.name))
        .await?
    else {
        return Ok(false);
    };
    let Some(mark) = ReleaseMark::from_variable(volume, &var) else {
        tracing::warn!(%volume, path = %var.path, "claim release mark is malformed; ignored");
        return Ok(false);
    };
    if mark.holder != holder || mark.claim_index != claim_index {
        return Ok(false);
    }
    match trust.verify(&mark) {
        Ok(()) => Ok(true),
        Err(e) => {
            tracing::warn!(%volume, holder, error = %e, "claim release mark does not carry a valid operator signature; ignored (the holder keeps the claim)");
            Ok(false)
        }
    }
}

/// The operator's last release of `holder`'s claim on `volume`, whatever claim index it
/// named, when its signature verifies with `trust`: for the audit line of a node that finds
/// its claim lost. Errors and malformed or unverified marks are `None`.
pub async fn last_release_of(
    client: &Client,
    trust: &RecordTrust,
    volume: &VolumeKey,
    holder: &str,
) -> Option<ReleaseMark> {
    let var = client
        .variable(&volume.namespace, &release_path(&volume.name))
        .await
        .ok()??;
    let mark = ReleaseMark::from_variable(volume, &var)?;
    (mark.holder == holder && trust.verify(&mark).is_ok()).then_some(mark)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_verifies_only_as_signed() {
        let (key, _) = SigningKey::generate().unwrap();
        let trust = RecordTrust::parse_keys(&key.public_line(), "k").unwrap();
        let vol = VolumeKey {
            namespace: "default".into(),
            name: "data".into(),
        };
        let mut m = ReleaseMark::new(vol.clone(), "node-a".into(), 7, 1);
        assert!(trust.verify(&m).is_err());
        m.sign(&key);
        let back = ReleaseMark::from_variable(&vol, &m.to_variable()).unwrap();
        assert_eq!(trust.verify(&back), Ok(()));
        for t in [
            |m: &mut ReleaseMark| m.holder = "node-b".into(),
            |m: &mut ReleaseMark| m.claim_index = 8,
            |m: &mut ReleaseMark| m.volume.name = "other".into(),
        ] {
            let mut bad = back.clone();
            t(&mut bad);
            assert!(trust.verify(&bad).is_err());
        }
    }
}
