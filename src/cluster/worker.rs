//! Which node runs a cluster-wide storage operation (snapshot, expand, create from a clone),
//! and the check-and-set write by which a node takes it.
//!
//! The rule (docs/plugin-protocol.md, "Which node runs it"): the node where the volume is
//! published, if it is published, so that the plugin can quiesce the mounted filesystem
//! (freeze, remount read-only) or grow it online; otherwise any node that has the plugin,
//! the first to win a check-and-set write of its node ID into the record (as for `create`).

use crate::nomad::types::Variable;
use crate::nomad::{Client, NomadError};

/// Where the operation's volume is published, as this node knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// Mounted on this node (the journal and the mount table agree).
    Here,
    /// Held by another node (its claim, or its placeholder has live allocations).
    Elsewhere,
    /// Published nowhere.
    Nowhere,
}

/// True when this node (`me`) should run an operation that `claimed_by` (a node ID, or `""`
/// when no node took it yet) may already hold. `has_plugin`: the plugin is on this node.
pub fn runs_here(me: &str, claimed_by: &str, published: Published, has_plugin: bool) -> bool {
    if !has_plugin || !(claimed_by.is_empty() || claimed_by == me) {
        return false;
    }
    match published {
        Published::Here | Published::Nowhere => true,
        Published::Elsewhere => false,
    }
}

/// A check-and-set write lost, or Nomad could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TakeError {
    /// Another writer changed the record since it was read: read it again, the other node
    /// probably took the operation.
    #[error("another node changed {path} first (check-and-set at index {index})")]
    Lost { path: String, index: u64 },
    #[error(transparent)]
    Nomad(#[from] NomadError),
}

/// Why a storage operation (snapshot, expand) did not complete on this node.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// The check-and-set write lost (another node took it), or Nomad failed.
    #[error(transparent)]
    Take(#[from] TakeError),
    /// The plugin call timed out: its outcome is unknown; the same node calls again.
    #[error("{0}")]
    Uncertain(String),
    /// The plugin refused for now (exit code 75, [`crate::storage::plugin::EXIT_TEMPORARY`]): the
    /// operation stays pending and the same node calls again after a backoff.
    #[error("{0}")]
    NotNow(String),
    /// A plugin call failed where no record keeps the failure (a delete); retried.
    #[error("{0}")]
    Plugin(String),
    /// A record read back from Nomad is not valid.
    #[error(transparent)]
    Record(#[from] crate::volume::RecordError),
}

impl OpError {
    /// The error to return for a plugin call whose operation stays pending and is called
    /// again on this node: a timeout (outcome unknown) or a "not now" refusal (exit code 75).
    /// `None` for a failure the record keeps. Redacted with `secrets`.
    pub fn retried(
        e: &crate::storage::plugin::PluginError,
        secrets: &std::collections::BTreeMap<String, String>,
    ) -> Option<OpError> {
        let text = || crate::storage::plugin::redact(&e.to_string(), secrets);
        if e.is_uncertain() {
            Some(OpError::Uncertain(text()))
        } else if e.is_temporary() {
            Some(OpError::NotNow(text()))
        } else {
            None
        }
    }

    /// True when another node took the operation first (not worth a warning).
    pub fn is_lost(&self) -> bool {
        matches!(self, OpError::Take(TakeError::Lost { .. }))
    }
}

/// Names one storage operation in flight or retried on this node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKey {
    /// A snapshot's create or delete, by snapshot ID.
    Snapshot(String),
    /// A volume's pending expansion.
    Expansion(crate::volume::VolumeKey),
}

impl std::fmt::Display for OpKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpKey::Snapshot(id) => write!(f, "snapshot {id}"),
            OpKey::Expansion(v) => write!(f, "expansion of {v}"),
        }
    }
}

/// Writes `var` if its ModifyIndex is still `index` (0 = must not exist yet).
pub async fn put_cas(client: &Client, var: &Variable, index: u64) -> Result<Variable, TakeError> {
    crate::cluster::changes::put_record(client, var, Some(index))
        .await
        .map_err(|e| match e {
            NomadError::CasConflict { .. } => TakeError::Lost {
                path: var.path.clone(),
                index,
            },
            e => TakeError::Nomad(e),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_publishing_node_runs_it_else_any_node_with_the_plugin() {
        use Published::*;
        // Published here: this node, and only with the plugin.
        assert!(runs_here("n1", "", Here, true));
        assert!(!runs_here("n1", "", Here, false));
        // Published on another node: never here.
        assert!(!runs_here("n1", "", Elsewhere, true));
        // Published nowhere: any node with the plugin, unless another took it.
        assert!(runs_here("n1", "", Nowhere, true));
        assert!(runs_here("n1", "n1", Nowhere, true));
        assert!(!runs_here("n1", "n2", Nowhere, true));
        assert!(!runs_here("n1", "n2", Here, true));
    }
}
