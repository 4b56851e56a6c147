//! The volume catalogue: every deferred volume record in the cluster, kept current with a
//! blocking query on the records' variables (Nomad API: `GET /v1/vars?prefix=dhv-binder/volumes/&namespace=*`).

use crate::nomad::types::VariableMeta;
use crate::nomad::Client;
use crate::retry::backoff_delay;
use crate::volume::{VolumeKey, VolumeRecord, RECORD_PREFIX};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio::sync::mpsc;

/// A full snapshot of the catalogue.
pub type Catalogue = BTreeMap<VolumeKey, VolumeRecord>;

/// Watches the records and sends a full catalogue after every change.
/// Records that do not decode are logged and left out (never deleted).
pub async fn run(client: Client, wait: Duration, tx: mpsc::Sender<Catalogue>) {
    let mut index = 0u64;
    let mut attempt = 0u32;
    let mut cache: HashMap<(String, String), (u64, Option<VolumeRecord>)> = HashMap::new();
    loop {
        let list = match client.list_variables(RECORD_PREFIX, "*", index, wait).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list volume records; retrying");
                tokio::time::sleep(backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                    attempt,
                ))
                .await;
                attempt = attempt.saturating_add(1);
                continue;
            }
        };
        attempt = 0;
        if list.index < index {
            // Index went backwards (restore): start over.
            cache.clear();
        }
        match load(&client, &list.value, &mut cache).await {
            Ok(cat) => {
                if tx.send(cat).await.is_err() {
                    return;
                }
                index = list.index.max(1);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read volume records; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn load(
    client: &Client,
    metas: &[VariableMeta],
    cache: &mut HashMap<(String, String), (u64, Option<VolumeRecord>)>,
) -> Result<Catalogue, crate::nomad::NomadError> {
    let mut seen = HashMap::new();
    for m in metas {
        let k = (m.namespace.clone(), m.path.clone());
        let cached = cache
            .get(&k)
            .filter(|(idx, _)| *idx == m.modify_index)
            .cloned();
        let entry = match cached {
            Some(c) => c,
            None => {
                let rec = match client.variable(&m.namespace, &m.path).await? {
                    Some(var) => match VolumeRecord::from_variable(&var) {
                        Ok(r) => Some(r),
                        Err(e) => {
                            tracing::warn!(error = %e, "ignoring a malformed volume record");
                            None
                        }
                    },
                    None => None,
                };
                (m.modify_index, rec)
            }
        };
        seen.insert(k, entry);
    }
    *cache = seen;
    Ok(cache
        .values()
        .filter_map(|(_, r)| r.clone())
        .map(|r| (r.key(), r))
        .collect())
}
