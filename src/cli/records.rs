//! The volume records as the commands read them: one record with whether it was
//! registered (Nomad API: GET /v1/var/:path), the allocations using a volume (from its
//! placeholders: GET /v1/volumes?type=host, GET /v1/volume/host/:id), and the operator's
//! signing key argument. Shared by `volume` and the storage commands (`snapshot`,
//! expansion) without either importing the other.

use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::cluster::trust::SigningKey;
use crate::nomad::Client;
use crate::volume::{self, VolumeRecord};
use serde::Serialize;
use std::path::PathBuf;

/// The item a registered record carries (beside [`VolumeRecord`]'s own): `volume delete`
/// refuses such a volume, since dhv-binder did not create its storage.
pub use crate::volume::REGISTERED_ITEM;

/// The operator's private key for the records a command writes.
#[derive(Debug, clap::Args)]
pub struct SigningArgs {
    /// The operator's private key (`volume keygen`): agents act only on records (and run a
    /// plugin's delete only on requests) signed with a key in their --record-keys file.
    #[arg(long = "signing-key", env = "DHV_BINDER_SIGNING_KEY")]
    pub signing_key: Option<PathBuf>,
}

impl SigningArgs {
    /// Loads the key, or warns that the record will be unsigned.
    pub(crate) fn load(&self) -> Result<Option<SigningKey>, Failure> {
        match &self.signing_key {
            Some(p) => SigningKey::load(p)
                .map(Some)
                .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string())),
            None => {
                eprintln!("warning: no --signing-key (DHV_BINDER_SIGNING_KEY): the record is unsigned and agents act on it only with --allow-unsigned-records");
                Ok(None)
            }
        }
    }
}

/// An allocation using a volume, from the placeholder Nomad keeps on its node.
#[derive(Debug, Serialize)]
pub struct VolumeUser {
    pub alloc_id: String,
    pub alloc_name: String,
    pub node_id: String,
}

pub(super) async fn read_var(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(VolumeRecord, bool), Failure> {
    volume::validate_identifier("name", name, true)
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    let var = client
        .variable(namespace, &volume::record_path(name))
        .await?
        .ok_or_else(|| {
            Failure::new(
                EXIT_FAILED,
                format!("volume {namespace}/{name} does not exist"),
            )
        })?;
    let registered = var.items.get(REGISTERED_ITEM).is_some_and(|v| v == "true");
    let rec =
        VolumeRecord::from_variable(&var).map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    Ok((rec, registered))
}

pub(super) async fn read_record(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<VolumeRecord, Failure> {
    Ok(read_var(client, namespace, name).await?.0)
}

/// Allocations using a volume, from its placeholders (Nomad denormalizes each host
/// volume's non-terminal allocations).
pub(super) async fn users_of(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<VolumeUser>, Failure> {
    let mut out = Vec::new();
    for stub in client.list_host_volumes(None, namespace).await? {
        if stub.name != name {
            continue;
        }
        if let Some(hv) = client.host_volume(namespace, &stub.id).await? {
            for a in hv.allocations {
                out.push(VolumeUser {
                    alloc_id: a.id,
                    alloc_name: a.name,
                    node_id: hv.node_id.clone(),
                });
            }
        }
    }
    Ok(out)
}
