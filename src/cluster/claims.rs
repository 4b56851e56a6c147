//! Claims across nodes: for single-node access modes, at most one node may have a volume
//! published at a time. The claim is a Nomad Variables lock on
//! `dhv-binder/claims/<name>` in the volume's namespace (Nomad API:
//! `PUT /v1/var/:path?lock-acquire|lock-renew|lock-release`), held with a TTL and renewed
//! while the volume is published. A node that cannot renew (partition, lost node, daemon
//! frozen) loses the claim when the TTL lapses; after Nomad's lock delay another node may
//! take it. Before that moment the holder fences the volume on itself (docs/architecture.md,
//! "Fencing"). A node that finds its claim lost unpublishes before anything else.

use super::trust::RecordTrust;
use crate::nomad::types::{Variable, VariableLock};
use crate::nomad::{Client, LockOp, NomadError};
use crate::volume::{encode_name, VolumeKey};
use std::collections::BTreeMap;
use std::time::Duration;

/// Variable path prefix of claims.
pub const CLAIM_PREFIX: &str = "dhv-binder/claims/";

/// True for access modes that allow the volume on one node at a time (`single-node-*`).
/// `multi-node-reader-only` and `multi-node-multi-writer` need no claim.
pub fn is_exclusive(access_mode: &str) -> bool {
    access_mode.starts_with("single-node-")
}

/// The variable path of a volume's claim.
pub fn claim_path(name: &str) -> String {
    format!("{CLAIM_PREFIX}{}", encode_name(name))
}

/// The claim's item listing the nodes fenced at the storage for this volume
/// (comma-separated node IDs): each node that takes the claim over adds the previous holder it
/// fenced (plugin `fence_node`) and removes itself. A node stays listed until it takes the
/// claim again, so a taker that dies before its `fence_node` finished leaves the fence for the
/// next taker to make.
pub const FENCED_NODES_ITEM: &str = "fenced_nodes";

/// What an acquire found and took: the lock ID, the claim variable's ModifyIndex after the
/// acquire (an operator's release mark of this claim names an index at least as high), and
/// the storage-side fencing owed before the publish (docs/plugin-protocol.md,
/// "fence_node and unfence_node").
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Acquired {
    /// The Nomad lock ID.
    pub lock_id: String,
    /// The claim variable's ModifyIndex after the acquire (0 when unknown).
    pub index: u64,
    /// Nodes whose access to the volume the plugin's `fence_node` must revoke before this
    /// node publishes: the previous holder when it was taken over (its node not `ready` in
    /// Nomad, or released by an operator's mark), and any node already listed.
    pub fence: Vec<String>,
    /// This node was listed as fenced (or was the last holder itself: a fence or unfence of
    /// its own take-over may not have finished): the plugin's `unfence_node` restores its
    /// access before its publish.
    pub unfence: bool,
    /// This node was listed as fenced: its access was revoked at the storage, and the
    /// unfence restores it. False with `unfence`: the node held the claim last and nothing
    /// says it was fenced (the unfence is a precaution, an idempotent no-op when nothing
    /// was revoked).
    pub was_fenced: bool,
}

impl From<&str> for Acquired {
    fn from(lock_id: &str) -> Self {
        Self {
            lock_id: lock_id.to_string(),
            ..Default::default()
        }
    }
}

/// The node IDs listed in a claim's [`FENCED_NODES_ITEM`].
pub fn fenced_nodes(items: &BTreeMap<String, String>) -> Vec<String> {
    items
        .get(FENCED_NODES_ITEM)
        .map(|s| {
            s.split(',')
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Claim timing.
#[derive(Debug, Clone, Copy)]
pub struct ClaimSettings {
    /// Lock TTL (Nomad accepts 10 s..=24 h); renewed every TTL/3. Nomad keeps a silent
    /// holder's lock for 2×TTL, then for the lock delay.
    pub ttl: Duration,
    /// Nomad's lock delay after a TTL expiry, before anyone may acquire again.
    pub lock_delay: Duration,
    /// How long before its lease ends a claim that could not be renewed is fenced on this
    /// node ([`crate::agent`]'s claims: the lease ends TTL + lock delay after the last
    /// renewal that succeeded was sent).
    pub fence_margin: Duration,
}

/// Why a claim call did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Another node holds the claim (or it is in its lock-delay period after an expiry).
    #[error("the claim on {volume} is held by {holder}")]
    Held {
        volume: VolumeKey,
        holder: String,
        /// The job of the holder's allocation using the volume, when one is known.
        job: Option<String>,
    },
    /// Our lock is gone (expired, or taken over): the volume must be unpublished here.
    #[error("this node lost its claim on {volume}")]
    Lost { volume: VolumeKey },
    /// A renewal was refused (409 or 404), but reading the claim proves no other holder: the
    /// lock is still held under this ID, or its Items still name this node (a new leader that
    /// has not re-armed its lock timers answers so). Retried like a transient error until the
    /// lease ends; past it, the claim is lost.
    #[error("the renewal of the claim on {volume} was refused, but the claim still names this node (a new Nomad leader re-arming its lock timers?); retrying")]
    Unproven { volume: VolumeKey },
    /// The claim was taken over, but the plugin's `fence_node` (revoke the old holder's
    /// access) or `unfence_node` (restore this node's) failed: the claim is given back and
    /// the take-over retried; the volume is not published meanwhile.
    #[error("took the claim on {volume}, but the plugin's {op} for node {node} failed, so the volume is not published here yet (retried; fix the storage-side fence, docs/plugin-protocol.md \"fence_node and unfence_node\"): {error}")]
    StorageFence {
        volume: VolumeKey,
        op: &'static str,
        node: String,
        error: String,
    },
    /// An operator released this node's claim (`volume claim release`, a verified mark that
    /// names this node and this claim): another node may publish the volume now, so it is
    /// fenced here at once.
    #[error("the claim on {volume} was released by an operator (signed `volume claim release` at claim index {claim_index}); another node may take the volume now")]
    ReleasedByOperator { volume: VolumeKey, claim_index: u64 },
    /// Nomad could not be asked; try again.
    #[error("claim on {volume}: {source}")]
    Nomad {
        volume: VolumeKey,
        #[source]
        source: NomadError,
    },
}

fn go_duration(d: Duration) -> String {
    format!("{}s", d.as_secs().max(1))
}

fn var(volume: &VolumeKey, items: BTreeMap<String, String>, lock: VariableLock) -> Variable {
    Variable {
        namespace: volume.namespace.to_string(),
        path: claim_path(&volume.name),
        items,
        lock: Some(lock),
        ..Default::default()
    }
}

/// What the claim's last holder, another node, is to a node that wants the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Previous {
    /// No claim yet, or this node was the last holder.
    None,
    /// Another node held it and is `ready` in Nomad with no live allocation using the
    /// volume: it released cleanly (or its tasks ended): no fence.
    Clean,
    /// Another node held it and may still write: its node is not `ready` (down,
    /// disconnected, gone; it fenced itself before its lock could lapse) or an operator
    /// released its claim. Taken over, with the storage-side fence of that node first.
    TakenOver(String),
    /// Another node holds it with a live allocation using the volume on a `ready` node: not
    /// taken over (message for the waiting caller, and the allocation's job).
    Live(String, String),
}

/// Hand-over on evidence: the last holder named in the claim's Items (`node_id`), when it
/// is another node that Nomad reports `ready` with a live allocation using the volume. Such a
/// holder's lock may have lapsed only because its agent is down (an upgrade, a crash loop)
/// while its tasks still write: the claim is not taken over until that allocation stops, its
/// node goes down or disconnected (its agent has fenced the volume by then: the lock lapses
/// only after the holder's fence), or the claim is released (cleanly, or by an operator's
/// signed mark). Also returns the claim's Items. Nomad API: `GET /v1/var/:path`,
/// `GET /v1/node/:id`, `GET /v1/node/:id/allocations`.
async fn previous_holder(
    client: &Client,
    trust: &RecordTrust,
    volume: &VolumeKey,
    node_id: &str,
) -> Result<(Previous, BTreeMap<String, String>), NomadError> {
    let Some(var) = client
        .variable(&volume.namespace, &claim_path(&volume.name))
        .await?
    else {
        return Ok((Previous::None, BTreeMap::new()));
    };
    let Some(holder) = var.items.get("node_id").filter(|h| *h != node_id) else {
        return Ok((Previous::None, var.items));
    };
    let holder = holder.clone();
    if super::claim_release::released_by_operator(client, trust, volume, &holder, var.modify_index)
        .await?
    {
        tracing::warn!(%volume, holder = %holder, "claim released by operator (signed `volume claim release`): taking it over without waiting for the holder's allocation to stop");
        return Ok((Previous::TakenOver(holder), var.items));
    }
    if client.node_status(&holder).await?.as_deref() != Some("ready") {
        return Ok((Previous::TakenOver(holder), var.items));
    }
    let (allocs, _) = client.node_allocations(&holder, 0, Duration::ZERO).await?;
    let live = allocs.value.into_iter().find(|a| {
        *a.namespace == *volume.namespace
            && !a.tasks_finished()
            && a.group().is_some_and(|g| {
                g.volumes
                    .values()
                    .any(|r| r.volume_type == "host" && *r.source == *volume.name)
            })
    });
    let Some(a) = live else {
        return Ok((Previous::Clean, var.items));
    };
    let name = node_name(client, &holder).await;
    Ok((
        Previous::Live(
            format!(
                "job {}, allocation {} on node {name}, which still runs with it",
                a.job_id,
                short(&a.id)
            ),
            a.job_id.to_string(),
        ),
        var.items,
    ))
}

/// The storage-side fencing an acquire by `node_id` owes, from the claim's Items before it
/// and what its last holder is: the nodes to fence (the listed ones and a holder taken over,
/// never this node), whether this node unfences itself (it was listed, or was the last
/// holder: a take-over of its own may have stopped half-way), and whether it was listed.
fn storage_fencing(
    node_id: &str,
    items: &BTreeMap<String, String>,
    previous: &Previous,
) -> (Vec<String>, bool, bool) {
    let listed = fenced_nodes(items);
    let mut fence: Vec<String> = listed.iter().filter(|n| *n != node_id).cloned().collect();
    if let Previous::TakenOver(h) = previous {
        if !fence.contains(h) {
            fence.push(h.clone());
        }
    }
    let last = items.get("node_id").map(String::as_str);
    let was_fenced = listed.iter().any(|n| n == node_id);
    (fence, was_fenced || last == Some(node_id), was_fenced)
}

/// The first 8 characters of an ID, as Nomad's CLI shows it.
fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// The node's name for messages, else its short ID. Nomad API: `GET /v1/node/:id`.
async fn node_name(client: &Client, node_id: &str) -> String {
    match client.node_name(node_id).await {
        Ok(Some(n)) if !n.is_empty() => n,
        _ => short(node_id).to_string(),
    }
}

/// Who holds the claim, for the claim-wait message, best effort: "job J, allocation A on
/// node N" (and job J) when a live allocation on the holder's node uses the volume, else
/// "node N". The
/// holder is the `node_id` of the claim's Items (every reader sees them: Nomad hides `Lock`
/// from non-management tokens, `Variables.Read`, and the 409 body names only the path; Items
/// keep the last holder through its lock delay). Nomad API: `GET /v1/var/:path`,
/// `GET /v1/node/:id`, `GET /v1/node/:id/allocations`.
async fn holder_of(client: &Client, volume: &VolumeKey) -> (String, Option<String>) {
    let Ok(Some(var)) = client
        .variable(&volume.namespace, &claim_path(&volume.name))
        .await
    else {
        return ("another node".into(), None);
    };
    let Some(node) = var.items.get("node_id") else {
        return ("another node".into(), None);
    };
    let name = node_name(client, node).await;
    let live = match client.node_allocations(node, 0, Duration::ZERO).await {
        Ok((allocs, _)) => allocs.value.into_iter().find(|a| {
            *a.namespace == *volume.namespace
                && !a.tasks_finished()
                && a.group().is_some_and(|g| {
                    g.volumes
                        .values()
                        .any(|r| r.volume_type == "host" && *r.source == *volume.name)
                })
        }),
        Err(_) => None,
    };
    match live {
        Some(a) => (
            format!(
                "job {}, allocation {} on node {name}",
                a.job_id,
                short(&a.id)
            ),
            Some(a.job_id.into()),
        ),
        None => (format!("node {name} (its allocation stopped: the claim is released soon, or lapses after its lock delay)"), None),
    }
}

/// Acquires the claim for this node. Refused ([`ClaimError::Held`]) while the last holder
/// is another node that Nomad reports `ready` with a live allocation using the volume, even
/// after its lock lapsed (hand-over on evidence, see `previous_holder`), unless an operator
/// released that holder's claim with a mark `trust` verifies ([`super::claim_release`]).
/// With `storage_fence` (the volume's plugin declares `fence_node`), the answer says which
/// nodes to fence at the storage and whether to unfence this node before the publish
/// ([`Acquired`]), and the claim's [`FENCED_NODES_ITEM`] lists the fenced nodes.
pub async fn acquire(
    client: &Client,
    trust: &RecordTrust,
    settings: ClaimSettings,
    volume: &VolumeKey,
    node_id: &str,
    volume_id: &str,
    storage_fence: bool,
) -> Result<Acquired, ClaimError> {
    let (previous, before) = match previous_holder(client, trust, volume, node_id).await {
        Ok((Previous::Live(holder, job), _)) => {
            return Err(ClaimError::Held {
                volume: volume.clone(),
                holder,
                job: Some(job),
            })
        }
        Ok(p) => p,
        Err(source) => {
            return Err(ClaimError::Nomad {
                volume: volume.clone(),
                source,
            })
        }
    };
    let (fence, unfence, was_fenced) = if storage_fence {
        storage_fencing(node_id, &before, &previous)
    } else {
        (Vec::new(), false, false)
    };
    let mut items = BTreeMap::from([
        ("node_id".to_string(), node_id.to_string()),
        ("volume_id".to_string(), volume_id.to_string()),
    ]);
    if !fence.is_empty() {
        items.insert(FENCED_NODES_ITEM.to_string(), fence.join(","));
    }
    let lock = VariableLock {
        id: String::new(),
        ttl: go_duration(settings.ttl).into(),
        lock_delay: go_duration(settings.lock_delay).into(),
    };
    match client
        .lock_op(LockOp::Acquire, &var(volume, items, lock))
        .await
    {
        Ok(v) => match v.lock.filter(|l| !l.id.is_empty()) {
            Some(l) => Ok(Acquired {
                lock_id: l.id,
                index: v.modify_index,
                fence,
                unfence,
                was_fenced,
            }),
            None => Err(ClaimError::Nomad {
                volume: volume.clone(),
                source: NomadError::Status {
                    what: "lock-acquire".into(),
                    status: 200,
                    body: "no lock ID in the answer".into(),
                },
            }),
        },
        Err(NomadError::CasConflict { .. }) => {
            let (holder, job) = holder_of(client, volume).await;
            Err(ClaimError::Held {
                volume: volume.clone(),
                holder,
                job,
            })
        }
        Err(source) => Err(ClaimError::Nomad {
            volume: volume.clone(),
            source,
        }),
    }
}

/// Renews the claim of `node_id`, acquired at the claim variable's ModifyIndex
/// `acquired_index` (`None`: unknown, a claim restored after a restart). A refusal (409, or
/// 404) is checked first against an operator's release mark: one that verifies with `trust`,
/// names this node and an index at or after `acquired_index` released this very claim
/// ([`ClaimError::ReleasedByOperator`]: fence at once). Otherwise the claim is read
/// (`lost_or_not`): [`ClaimError::Lost`] only when another holder, or no lock, is proven;
/// [`ClaimError::Unproven`] otherwise.
pub async fn renew(
    client: &Client,
    trust: &RecordTrust,
    volume: &VolumeKey,
    lock_id: &str,
    node_id: &str,
    acquired_index: Option<u64>,
) -> Result<(), ClaimError> {
    let lock = VariableLock {
        id: lock_id.to_string(),
        ..Default::default()
    };
    match client
        .lock_op(LockOp::Renew, &var(volume, BTreeMap::new(), lock))
        .await
    {
        Ok(_) => Ok(()),
        Err(NomadError::CasConflict { .. }) => {
            let mark = super::claim_release::last_release_of(client, trust, volume, node_id).await;
            if let Some(m) = &mark {
                if acquired_index.is_some_and(|i| m.claim_index >= i) {
                    tracing::warn!(%volume, released_unix_ms = m.unix_ms, claim_index = m.claim_index, "claim released by operator (signed `volume claim release`): fencing the volume here at once");
                    return Err(ClaimError::ReleasedByOperator {
                        volume: volume.clone(),
                        claim_index: m.claim_index,
                    });
                }
            }
            let e = lost_or_not(client, volume, lock_id, node_id).await;
            if let (ClaimError::Lost { .. }, Some(m)) = (&e, &mark) {
                tracing::warn!(%volume, released_unix_ms = m.unix_ms, claim_index = m.claim_index, "claim released by operator (signed `volume claim release`)");
            }
            Err(e)
        }
        Err(source) => Err(ClaimError::Nomad {
            volume: volume.clone(),
            source,
        }),
    }
}

/// A renewal answered 409 or 404 proves no other holder by itself: a new leader answers so
/// until it has re-armed its lock timers (`nomad/leader.go` `establishLeadership` runs
/// `restoreLockTTLTimers`; `nomad/locks.go` `RenewTTLTimer` fails without a timer). The claim
/// is read first. [`ClaimError::Lost`] when the variable is gone, its lock is held under
/// another ID, or its Items name another node (an acquire rewrites them); otherwise
/// [`ClaimError::Unproven`]: the lock is still held under this ID, or (a token that may not
/// see `Lock`: `Variables.Read` hides it from non-management tokens) the Items still name
/// this node. Nomad API: `GET /v1/var/:path`.
async fn lost_or_not(
    client: &Client,
    volume: &VolumeKey,
    lock_id: &str,
    node_id: &str,
) -> ClaimError {
    let lost = ClaimError::Lost {
        volume: volume.clone(),
    };
    match client
        .variable(&volume.namespace, &claim_path(&volume.name))
        .await
    {
        Ok(None) => lost,
        Ok(Some(v)) => {
            let ours = match v.lock.as_ref().filter(|l| !l.id.is_empty()) {
                Some(l) => l.id == lock_id,
                None => v.items.get("node_id").map(String::as_str) == Some(node_id),
            };
            if ours {
                ClaimError::Unproven {
                    volume: volume.clone(),
                }
            } else {
                lost
            }
        }
        Err(source) => ClaimError::Nomad {
            volume: volume.clone(),
            source,
        },
    }
}

/// Releases the claim. A lock already gone is success.
pub async fn release(client: &Client, volume: &VolumeKey, lock_id: &str) -> Result<(), ClaimError> {
    let lock = VariableLock {
        id: lock_id.to_string(),
        ..Default::default()
    };
    match client
        .lock_op(LockOp::Release, &var(volume, BTreeMap::new(), lock))
        .await
    {
        Ok(_) | Err(NomadError::CasConflict { .. }) => Ok(()),
        // `VarLockRelease` (nomad/state/state_store_variables.go) answers an uncoded error
        // (HTTP 500) when the variable or its lock is already gone: released.
        Err(NomadError::Status {
            status: 500, body, ..
        }) if body.contains("doesn't hold a lock") || body.contains("variable doesn't exist") => {
            Ok(())
        }
        Err(source) => Err(ClaimError::Nomad {
            volume: volume.clone(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Who is fenced and unfenced at the storage by an acquire (docs/plugin-protocol.md,
    /// "fence_node and unfence_node").
    #[test]
    fn an_acquire_fences_a_holder_taken_over_and_the_listed_nodes_and_unfences_itself() {
        let items = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // A holder taken over (its node down): fenced.
        let (fence, unfence, was) = storage_fencing(
            "b",
            &items(&[("node_id", "a")]),
            &Previous::TakenOver("a".into()),
        );
        assert_eq!((fence, unfence, was), (vec!["a".to_string()], false, false));
        // A clean release: nobody fenced.
        let (fence, unfence, was) =
            storage_fencing("b", &items(&[("node_id", "a")]), &Previous::Clean);
        assert_eq!((fence, unfence, was), (vec![], false, false));
        // Listed nodes stay fenced (fenced again: idempotent), the acquiring one is unfenced:
        // it was fenced.
        let (fence, unfence, was) = storage_fencing(
            "a",
            &items(&[("node_id", "b"), (FENCED_NODES_ITEM, "a,c")]),
            &Previous::Clean,
        );
        assert_eq!((fence, unfence, was), (vec!["c".to_string()], true, true));
        // The last holder itself (a take-over of its own stopped half-way): unfenced again
        // as a precaution (nothing says it was fenced), and the listed node fenced again.
        let (fence, unfence, was) = storage_fencing(
            "b",
            &items(&[("node_id", "b"), (FENCED_NODES_ITEM, "a")]),
            &Previous::None,
        );
        assert_eq!((fence, unfence, was), (vec!["a".to_string()], true, false));
        assert_eq!(
            fenced_nodes(&items(&[(FENCED_NODES_ITEM, "a,,b")])),
            vec!["a".to_string(), "b".to_string()]
        );
    }

    #[test]
    fn exclusive_modes() {
        assert!(is_exclusive("single-node-writer"));
        assert!(is_exclusive("single-node-reader-only"));
        assert!(is_exclusive("single-node-multi-writer"));
        assert!(!is_exclusive("multi-node-reader-only"));
        assert!(!is_exclusive("multi-node-multi-writer"));
        assert_eq!(claim_path("data[1]"), "dhv-binder/claims/data~5b1~5d");
    }
}
