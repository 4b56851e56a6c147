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

/// An allocation using a volume, from the placeholder Nomad keeps on its node; in `-json`
/// under the names of Nomad's allocation stub (`ID`, `Name`, `NodeID`), as in the
/// `Allocations` of Nomad's host volume.
#[derive(Debug, Serialize)]
pub struct VolumeUser {
    #[serde(rename = "ID")]
    pub alloc_id: String,
    #[serde(rename = "Name")]
    pub alloc_name: String,
    #[serde(rename = "NodeID")]
    pub node_id: String,
    /// The allocation's job.
    #[serde(rename = "JobID")]
    pub job_id: String,
    /// The allocation's client status as Nomad reports it (`pending`, `running`, ...).
    #[serde(rename = "ClientStatus")]
    pub client_status: String,
    /// Where the placeholder (and the volume, once published) is on the node.
    #[serde(rename = "HostPath")]
    pub host_path: String,
}

pub(super) async fn read_var(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(VolumeRecord, bool), Failure> {
    volume::validate_identifier("name", name, true)
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    if namespace == "*" {
        return in_any_namespace(client, name).await;
    }
    let var = match client
        .variable(namespace, &volume::record_path(name))
        .await?
    {
        Some(var) => var,
        None => by_id_prefix(client, namespace, name).await?,
    };
    let registered = var.items.get(REGISTERED_ITEM).is_some_and(|v| v == "true");
    let rec =
        VolumeRecord::from_variable(&var).map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    Ok((rec, registered))
}

/// `-namespace '*'`: the one record, in any namespace, whose name is `name` or whose ID
/// starts with it (as `nomad volume status -namespace '*'` finds a volume); refused when
/// several namespaces have one, naming them.
async fn in_any_namespace(client: &Client, name: &str) -> Result<(VolumeRecord, bool), Failure> {
    let metas = client
        .list_variables(volume::RECORD_PREFIX, "*", 0, std::time::Duration::ZERO)
        .await?
        .value;
    let path = volume::record_path(name);
    let hex = name.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    let mut found = Vec::new();
    for m in metas {
        if m.path != path && !hex {
            continue;
        }
        if let Some(var) = client.variable(&m.namespace, &m.path).await? {
            if m.path == path || var.items.get("id").is_some_and(|id| id.starts_with(name)) {
                found.push(var);
            }
        }
    }
    match found.len() {
        0 => Err(Failure::new(
            EXIT_FAILED,
            format!("no namespace has a volume named {name:?} or with that ID prefix (`dhv-binder volume list -namespace '*'` shows them)"),
        )),
        1 => {
            let var = found.remove(0);
            let registered = var.items.get(REGISTERED_ITEM).is_some_and(|v| v == "true");
            let rec = VolumeRecord::from_variable(&var)
                .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
            Ok((rec, registered))
        }
        _ => Err(Failure::new(
            EXIT_FAILED,
            format!(
                "{name:?} names a volume in {} namespaces ({}): give -namespace",
                found.len(),
                found
                    .iter()
                    .map(|v| v.namespace.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// The record whose volume ID starts with `prefix` (as Nomad accepts unique ID
/// prefixes wherever an ID is): refused when none or several match, naming them.
async fn by_id_prefix(
    client: &Client,
    namespace: &str,
    prefix: &str,
) -> Result<crate::nomad::types::Variable, Failure> {
    let missing = || {
        Failure::new(
            EXIT_FAILED,
            format!("volume {namespace}/{prefix} does not exist (no volume has that name or ID prefix; `dhv-binder volume list` shows them)"),
        )
    };
    if !prefix.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
        return Err(missing());
    }
    let metas = client
        .list_variables(
            volume::RECORD_PREFIX,
            namespace,
            0,
            std::time::Duration::ZERO,
        )
        .await?
        .value;
    let mut found = Vec::new();
    for m in metas {
        if let Some(var) = client.variable(&m.namespace, &m.path).await? {
            if var.items.get("id").is_some_and(|id| id.starts_with(prefix)) {
                found.push(var);
            }
        }
    }
    match found.len() {
        0 => Err(missing()),
        1 => Ok(found.remove(0)),
        _ => {
            let names: Vec<String> = found
                .iter()
                .map(|v| {
                    format!(
                        "{} ({})",
                        v.path.trim_start_matches(volume::RECORD_PREFIX),
                        v.items.get("id").map(String::as_str).unwrap_or_default()
                    )
                })
                .collect();
            Err(Failure::new(
                EXIT_FAILED,
                format!(
                    "ID prefix {prefix:?} matches {} volumes: {}; give more of the ID or the name",
                    names.len(),
                    names.join(", ")
                ),
            ))
        }
    }
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
                    job_id: a.job_id,
                    client_status: a.client_status,
                    host_path: hv.host_path.clone(),
                });
            }
        }
    }
    Ok(out)
}

/// The key ID a record's signature names (`ed25519:<key id>:<sig>`), or `unsigned`.
fn signer(rec: &VolumeRecord) -> String {
    match rec.signature.split(':').nth(1) {
        Some(id) if !rec.signature.is_empty() => format!("key {id}"),
        _ if rec.signature.is_empty() => "no key (unsigned)".into(),
        _ => "a malformed signature".into(),
    }
}

/// Signs a pending record (no node has taken its create) again with `key`, the fix a node's
/// refusal names ("sign with a trusted key", "write it with the operator's key"): written
/// only when the signature changes, with the record's ModifyIndex (Nomad API:
/// `PUT /v1/var/:path?cas=<index>`). Returns the record as written and a line saying what
/// changed, or `None` when it already carries this key's signature.
pub(super) async fn resign_pending(
    client: &Client,
    cur: &VolumeRecord,
    key: &SigningKey,
) -> Result<Option<(VolumeRecord, String)>, Failure> {
    let mut rec = cur.clone();
    key.sign(&mut rec);
    if rec.signature == cur.signature {
        return Ok(None);
    }
    let line = format!(
        "==> Volume {} is pending, signed by {}: signed it again with key {}",
        cur.key(),
        signer(cur),
        rec.signature.split(':').nth(1).unwrap_or_default()
    );
    match crate::cluster::changes::put_record(client, &rec.to_variable(), Some(cur.modify_index))
        .await
    {
        Ok(_) => Ok(Some((rec, line))),
        Err(crate::nomad::NomadError::CasConflict { .. }) => Err(Failure::new(
            EXIT_FAILED,
            format!(
                "volume {} changed while it was being signed again (a node took its create, or another operator wrote it): run the command again",
                cur.key()
            ),
        )),
        Err(e) => Err(e.into()),
    }
}
