//! A volume's "final" publish failure: a plugin's publish failed with the class `final`
//! (the volume itself is broken: docs/plugin-protocol.md, "Error classes"). The node that
//! saw it writes it into the record (item `final_failure`, by check-and-set); every node
//! then stops offering the volume (no placeholder where it is not published, a waiting
//! prestart refused at once with the plugin's words) until an operator runs
//! `dhv-binder volume update -repaired <volume>`, which clears it.
//!
//! The item is not signed (nodes write it, as they write `state` and `error`): a forged one
//! can only make nodes withhold the volume, never publish anything, which a writer of the
//! record can already do by changing its state.

use serde::{Deserialize, Serialize};

/// The record item holding a [`FinalFailure`] as JSON; absent when there is none.
pub const ITEM: &str = "final_failure";

/// The most characters of the plugin's words kept in the record.
pub const MAX_ERROR: usize = 300;

/// Who saw the volume fail for good, when, and the plugin's (redacted) words.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FinalFailure {
    /// The Nomad node ID of the node whose publish failed.
    pub node_id: String,
    /// That node's name (for `volume status`).
    pub node_name: String,
    /// Unix seconds (that node's clock).
    pub time: u64,
    /// The plugin's words, redacted, cut to [`MAX_ERROR`] characters.
    pub error: String,
}

impl FinalFailure {
    /// A failure seen now on `node_id` (`node_name`), `error` cut to [`MAX_ERROR`].
    pub fn new(node_id: &str, node_name: &str, error: &str) -> Self {
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        FinalFailure {
            node_id: node_id.into(),
            node_name: node_name.into(),
            time,
            error: error.chars().take(MAX_ERROR).collect(),
        }
    }

    /// One line for `volume status` and a refused prestart: the plugin's words first (a
    /// prestart's line is cut at 199 characters).
    pub fn reason(&self) -> String {
        format!(
            "{} (class \"final\" on node {}: no node offers the volume until `dhv-binder volume update -repaired`)",
            self.error,
            if self.node_name.is_empty() { &self.node_id } else { &self.node_name },
        )
    }

    /// The item's value.
    pub fn to_item(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads the item (`""`: none). A malformed one is an error: the record is refused
    /// (never read as "no failure").
    pub fn from_item(s: &str) -> Result<Option<FinalFailure>, String> {
        if s.is_empty() {
            return Ok(None);
        }
        serde_json::from_str(s)
            .map(Some)
            .map_err(|e| format!("{ITEM}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The item round-trips; a garbled one is refused, not read as none; the words are cut.
    #[test]
    fn the_item_round_trips_and_a_garbled_one_is_refused() {
        let f = FinalFailure::new("n1", "node-1", &"x".repeat(1000));
        assert_eq!(f.error.len(), MAX_ERROR);
        assert_eq!(FinalFailure::from_item(&f.to_item()).unwrap(), Some(f));
        assert_eq!(FinalFailure::from_item("").unwrap(), None);
        assert!(FinalFailure::from_item("{").is_err());
        assert!(FinalFailure::from_item(r#"{"nodeid":"x"}"#).is_err());
    }
}
