//! The operator's forced unpublish of a volume on one node (`volume unpublish -node N
//! -force`): a request signed with the operator's key, in the variable
//! `dhv-binder/unpublish-requests/<name>` of the volume's namespace, that the named node's
//! agent acts on (the operator's machine is not the node: the request travels through the
//! records the agents already follow, as [`super::claim_release`]'s marks do).
//!
//! The operator signs the volume's place, the node, `kill` (whether the processes holding
//! the mount are to be killed), the request's ID, its time and who asked. The agent writes
//! the outcome back into the same variable (`state`, `message`), unsigned: it is a report
//! for the waiting CLI, never an instruction. A node acts on a request only when it names
//! that node, verifies with its `--record-keys`, is not older than [`MAX_AGE_MS`] (a saved
//! request written back later does nothing) and is still `pending`.
//!
//! Nomad API: `GET /v1/var/:path`, `PUT /v1/var/:path`.

use super::trust::{RecordTrust, Refusal, Signed, SigningKey};
use crate::nomad::types::Variable;
use crate::nomad::{Client, NomadError};
use crate::volume::{encode_name, VolumeKey};
use std::collections::BTreeMap;

/// Variable path prefix of the unpublish requests.
pub const REQUEST_PREFIX: &str = "dhv-binder/unpublish-requests/";

/// How old a request may be when a node first acts on it (milliseconds): 10 minutes.
pub const MAX_AGE_MS: u64 = 10 * 60 * 1000;

/// The variable path of a volume's unpublish request.
pub fn request_path(name: &str) -> String {
    format!("{REQUEST_PREFIX}{}", encode_name(name))
}

/// Where a request stands, as its `state` item says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    /// Written by the operator; the node has not answered yet.
    Pending,
    /// The node unpublished the volume (or found it not mounted).
    Done,
    /// The node refused (a process holds the mount and `kill` was not asked, or the request
    /// does not verify there); `message` says why.
    Refused,
}

impl RequestState {
    /// The `state` item's text.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Done => "done",
            Self::Refused => "refused",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Self::Pending),
            "done" => Some(Self::Done),
            "refused" => Some(Self::Refused),
            _ => None,
        }
    }
}

/// An operator's request to unpublish one volume on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpublishRequest {
    /// The volume.
    pub volume: VolumeKey,
    /// The node that is to unpublish it (its Nomad node ID).
    pub node_id: String,
    /// Kill the processes holding the mount (as the fence does) instead of refusing.
    pub kill: bool,
    /// The request's ID (a UUID): the node answers each request once.
    pub id: String,
    /// When the operator asked (Unix milliseconds; signed).
    pub unix_ms: u64,
    /// Who asked, as the operator's machine names them (user@host; signed, informational:
    /// the signature's key ID is what authenticates).
    pub requested_by: String,
    /// Where the request stands (written by the node; not signed).
    pub state: RequestState,
    /// The node's answer (not signed).
    pub message: String,
    /// `ed25519:<key id>:<base64>` over the place and the signed fields.
    pub signature: String,
    /// The variable's ModifyIndex (0 for a request not read from Nomad): the node's answer
    /// is written by check-and-set on it.
    pub modify_index: u64,
    no_delete: String,
}

/// Why a request's variable cannot be read as one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    /// An item is missing or malformed.
    #[error("unpublish request {path} is malformed: item {item:?} is missing or invalid; write it again with `dhv-binder volume unpublish`")]
    Malformed {
        /// The variable's path.
        path: String,
        /// The item at fault.
        item: &'static str,
    },
}

impl UnpublishRequest {
    /// A new, unsigned, pending request.
    pub fn new(
        volume: VolumeKey,
        node_id: String,
        kill: bool,
        id: String,
        unix_ms: u64,
        requested_by: String,
    ) -> Self {
        Self {
            volume,
            node_id,
            kill,
            id,
            unix_ms,
            requested_by,
            state: RequestState::Pending,
            message: String::new(),
            signature: String::new(),
            modify_index: 0,
            no_delete: String::new(),
        }
    }

    /// Signs the request with the operator's key.
    pub fn sign(&mut self, key: &SigningKey) {
        key.sign(self);
    }

    /// The ID of the key that signed it (from its signature), `None` when unsigned.
    pub fn signer(&self) -> Option<&str> {
        let mut parts = self.signature.splitn(3, ':');
        (parts.next() == Some("ed25519"))
            .then(|| parts.next())
            .flatten()
            .filter(|k| !k.is_empty())
    }

    /// Who asked, for the audit: the key that signed it and the name the operator's
    /// machine gave.
    pub fn who(&self) -> String {
        format!(
            "{} (key {})",
            crate::escape::escape_control(&self.requested_by),
            self.signer().unwrap_or("none: unsigned")
        )
    }

    /// Whether a node may act on it at `now_ms`: pending, and not older than [`MAX_AGE_MS`]
    /// (nor from more than a minute in the future).
    pub fn actionable(&self, now_ms: u64) -> bool {
        self.state == RequestState::Pending
            && now_ms.saturating_sub(self.unix_ms) <= MAX_AGE_MS
            && self.unix_ms <= now_ms.saturating_add(60_000)
    }

    /// The request as its variable.
    pub fn to_variable(&self) -> Variable {
        Variable {
            namespace: self.volume.namespace.to_string(),
            path: request_path(&self.volume.name),
            items: BTreeMap::from([
                ("node_id".into(), self.node_id.clone()),
                ("kill".into(), self.kill.to_string()),
                ("request_id".into(), self.id.clone()),
                ("unix_ms".into(), self.unix_ms.to_string()),
                ("requested_by".into(), self.requested_by.clone()),
                ("state".into(), self.state.as_str().into()),
                ("message".into(), self.message.clone()),
                ("signature".into(), self.signature.clone()),
            ]),
            ..Default::default()
        }
    }

    /// Reads a request from its variable (the volume from its namespace and path).
    pub fn from_variable(var: &Variable) -> Result<Self, RequestError> {
        let bad = |item| RequestError::Malformed {
            path: var.path.clone(),
            item,
        };
        let volume = var
            .path
            .strip_prefix(REQUEST_PREFIX)
            .and_then(super::changes::decode_name)
            .filter(|n| crate::volume::validate_identifier("name", n, true).is_ok())
            .map(|name| VolumeKey {
                namespace: var.namespace.clone().into(),
                name: name.into(),
            })
            .ok_or_else(|| bad("path"))?;
        let volume = &volume;
        let item = |k: &'static str| var.items.get(k).cloned().ok_or_else(|| bad(k));
        let mut r = Self::new(
            volume.clone(),
            item("node_id")?,
            item("kill")?.parse().map_err(|_| bad("kill"))?,
            item("request_id")?,
            item("unix_ms")?.parse().map_err(|_| bad("unix_ms"))?,
            item("requested_by")?,
        );
        r.state = RequestState::parse(&item("state")?).ok_or_else(|| bad("state"))?;
        r.message = var.items.get("message").cloned().unwrap_or_default();
        r.signature = var.items.get("signature").cloned().unwrap_or_default();
        r.modify_index = var.modify_index;
        Ok(r)
    }
}

/// Decodes a request's variable and checks its signature with `trust` (the record watch's
/// admission, [`crate::cluster::trust::admit`]).
pub fn admit(var: &Variable, trust: &RecordTrust) -> Result<UnpublishRequest, Refusal> {
    super::trust::admit(var, trust, UnpublishRequest::from_variable)
}

/// The verified requests, by volume.
pub type Requests = BTreeMap<VolumeKey, UnpublishRequest>;

/// Follows the requests (as [`crate::cluster::snapshot::watch`] follows the snapshot
/// records: the change marker, then each named variable) and sends every verified one on
/// `tx` after each change; the agent keeps those that name its node. Refused ones are
/// logged and listed in `rejected`.
pub async fn watch(
    client: Client,
    follow: super::catalog::Follow,
    trust: RecordTrust,
    rejected: super::catalog::Rejections,
    tx: tokio::sync::mpsc::Sender<Requests>,
) {
    let kind = super::catalog::Kind {
        prefix: REQUEST_PREFIX,
        admit,
        refused: |namespace, path, reason| {
            use crate::escape::escape_control;
            tracing::warn!(
                namespace = %escape_control(namespace),
                path = %escape_control(path),
                reason = %escape_control(reason),
                "refusing an unpublish request: no node acts on it"
            );
        },
    };
    super::catalog::follow(client, kind, follow, trust, rejected, requests_of, tx).await
}

fn requests_of(cache: &super::catalog::Cache<UnpublishRequest>) -> Requests {
    cache
        .values()
        .filter_map(|(_, r)| r.clone().and_then(Result::ok))
        .map(|r| (r.volume.clone(), r))
        .collect()
}

/// Writes the node's answer into the request's variable (check-and-set on the ModifyIndex
/// it was read at: a newer request is never overwritten) and announces it. Nomad API:
/// `PUT /v1/var/:path?cas=N`.
pub async fn answer(
    client: &Client,
    request: &UnpublishRequest,
    state: RequestState,
    message: &str,
) -> Result<(), NomadError> {
    let mut r = request.clone();
    r.state = state;
    r.message = message.to_string();
    super::changes::put_record(client, &r.to_variable(), Some(request.modify_index))
        .await
        .map(|_| ())
}

impl Signed for UnpublishRequest {
    fn place(&self) -> (String, String, String) {
        (
            self.volume.namespace.to_string(),
            request_path(&self.volume.name),
            self.id.clone(),
        )
    }
    fn signed_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("op", "force-unpublish".into()),
            ("volume", self.volume.name.to_string().into()),
            ("node_id", self.node_id.clone().into()),
            ("kill", self.kill.into()),
            ("unix_ms", self.unix_ms.into()),
            ("requested_by", self.requested_by.clone().into()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::trust::RecordTrust;

    fn vol() -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: "data".into(),
        }
    }

    #[test]
    fn a_request_verifies_only_as_signed_and_names_its_signer() {
        let (key, _) = SigningKey::generate().unwrap();
        let trust = RecordTrust::parse_keys(&key.public_line(), "k").unwrap();
        let mut r = UnpublishRequest::new(
            vol(),
            "node-a".into(),
            false,
            "req-1".into(),
            1_000,
            "ops@laptop".into(),
        );
        assert!(trust.verify(&r).is_err());
        assert_eq!(r.signer(), None);
        r.sign(&key);
        let back = UnpublishRequest::from_variable(&r.to_variable()).unwrap();
        assert_eq!(trust.verify(&back), Ok(()));
        assert!(back.who().starts_with("ops@laptop (key "), "{}", back.who());
        assert!(!back.who().contains("unsigned"), "{}", back.who());
        for t in [
            |r: &mut UnpublishRequest| r.node_id = "node-b".into(),
            |r: &mut UnpublishRequest| r.kill = true,
            |r: &mut UnpublishRequest| r.unix_ms = 2_000,
            |r: &mut UnpublishRequest| r.id = "req-2".into(),
            |r: &mut UnpublishRequest| r.requested_by = "someone-else".into(),
            |r: &mut UnpublishRequest| r.volume.name = "other".into(),
        ] {
            let mut bad = back.clone();
            t(&mut bad);
            assert!(trust.verify(&bad).is_err(), "{bad:?}");
        }
        // The node's answer is not signed: writing it keeps the signature valid.
        let mut answered = back.clone();
        answered.state = RequestState::Done;
        answered.message = "unpublished".into();
        assert_eq!(trust.verify(&answered), Ok(()));
    }

    #[test]
    fn only_a_fresh_pending_request_is_actionable() {
        let mut r = UnpublishRequest::new(
            vol(),
            "node-a".into(),
            true,
            "req-1".into(),
            1_000_000,
            "ops".into(),
        );
        assert!(r.actionable(1_000_000));
        assert!(r.actionable(1_000_000 + MAX_AGE_MS));
        assert!(!r.actionable(1_000_001 + MAX_AGE_MS), "too old");
        assert!(!r.actionable(1_000_000 - 60_001), "from the future");
        r.state = RequestState::Done;
        assert!(!r.actionable(1_000_000), "answered once");
    }

    #[test]
    fn a_malformed_request_names_its_item() {
        let mut v = UnpublishRequest::new(vol(), "n".into(), false, "r".into(), 1, "o".into())
            .to_variable();
        v.items.insert("kill".into(), "maybe".into());
        assert_eq!(
            UnpublishRequest::from_variable(&v),
            Err(RequestError::Malformed {
                path: v.path.clone(),
                item: "kill"
            })
        );
    }
}
