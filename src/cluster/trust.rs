//! Record trust: volume records are instructions to root on every node, so agents act only on
//! records an operator signed (docs/security.md).
//!
//! The operator's CLI signs, with an Ed25519 key kept off the cluster, what decides what a node
//! does as root: the record's ID, its variable (namespace and path), its spec and its secrets
//! (and, for a registered volume, the context the operator gave) ([`signed_payload`]), and
//! separately each delete request, bound to the exact record it deletes: its context and its
//! variable's CreateIndex ([`delete_payload`]). Snapshot requests are signed the same way
//! ([`Signed`]; their fields in `crate::cluster::snapshot`). Agents verify with public keys
//! configured on the node (`--record-keys`), never read from Nomad. Fields a node writes back
//! (state, a created volume's plugin context, capacity, worker node, error) are not signed:
//! they are untrusted input. The reference plugins never take a storage path from them: they
//! derive it from the signed parameters, namespace and ID and refuse a context that names
//! anything else (docs/security.md); a `deleting` state is acted on only with a valid delete
//! signature.
//!
//! Key files are text: a private key is one line `ed25519-private <base64 PKCS#8>`; a public
//! key file holds one `ed25519 <base64 32-byte key>` per line (`#` comments, blank lines).

use crate::volume::{record_path, VolumeRecord, VolumeState};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use std::path::Path;

/// Prefix of a signature value in a record: `ed25519:<key id>:<base64 signature>`.
const SIG_PREFIX: &str = "ed25519:";

/// Why a record or a key was refused. Each says what to do.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TrustError {
    #[error("the record is not signed: write it with the operator's key (`dhv-binder volume create` or `volume snapshot create` with `--signing-key <file>`)")]
    Unsigned,
    #[error("the record's signature does not verify with the key it names: the record was changed after it was signed (forged or altered); write it again with the operator's key")]
    BadSignature,
    /// The signature names a key (its ID, [`key_id`]) that is not in this node's
    /// `--record-keys`.
    #[error("the record is signed by key {0}, which this node does not trust: add that key's public line (from `volume keygen`) to --record-keys on every node, or sign with a trusted key")]
    UntrustedKey(String),
    #[error("the record is in state deleting without a valid operator delete signature: run `dhv-binder volume delete` (or `volume snapshot delete`) with `--signing-key <file>`")]
    UnsignedDelete,
    #[error("the signature field {0:?} is not `ed25519:<key id>:<base64>`")]
    Malformed(String),
    #[error("cannot read key file {path}: {reason}")]
    KeyFile { path: String, reason: String },
    /// The key file could be changed by a user other than root and the agent: whoever
    /// can write it chooses which records this node acts on.
    #[error("refusing key file {path}: {reason}; make it root's and writable by its owner only: run `chown root {path} && chmod go-w {path}`")]
    UnsafeKeyFile { path: String, reason: String },
    #[error("no record keys configured: give the agent --record-keys <file> (operators' public keys, see docs/security.md), or --allow-unsigned-records on a test cluster only")]
    NotConfigured,
}

/// Why an agent refused a record: the closed set the refused-records metric counts
/// (`dhv_binder_records_refused_total{reason}`, docs/operations/metrics.md "Metrics").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusedReason {
    /// The variable does not decode as a record: a field missing or of the wrong shape, an
    /// ID that is no UUID, a record copied to another path or namespace.
    Malformed,
    /// No signature ([`TrustError::Unsigned`]).
    Unsigned,
    /// The signature field is not `ed25519:<key id>:<base64>` ([`TrustError::Malformed`]).
    MalformedSignature,
    /// Signed by a key this node does not trust ([`TrustError::UntrustedKey`]).
    UntrustedKey,
    /// The signature does not verify with the key it names: the record was changed after
    /// it was signed ([`TrustError::BadSignature`]).
    BadSignature,
    /// `deleting` without a valid delete signature for this very record: none, or one
    /// replayed from another record or from an earlier record of the same name (a delete
    /// signature binds the variable's CreateIndex) ([`TrustError::UnsignedDelete`]).
    UnsignedDelete,
    /// A line of the change marker (`cluster::changes`) that names no record: a namespace
    /// or a path that is not a record's (a query, `..`, another endpoint). Nothing is read
    /// for it.
    MarkerLine,
}

impl RefusedReason {
    /// Every reason, in the order the metrics list them.
    pub const ALL: [RefusedReason; 7] = [
        RefusedReason::Malformed,
        RefusedReason::Unsigned,
        RefusedReason::MalformedSignature,
        RefusedReason::UntrustedKey,
        RefusedReason::BadSignature,
        RefusedReason::UnsignedDelete,
        RefusedReason::MarkerLine,
    ];

    /// The metric's label value (kebab-case).
    pub fn as_str(self) -> &'static str {
        match self {
            RefusedReason::Malformed => "malformed",
            RefusedReason::Unsigned => "unsigned",
            RefusedReason::MalformedSignature => "malformed-signature",
            RefusedReason::UntrustedKey => "untrusted-key",
            RefusedReason::BadSignature => "bad-signature",
            RefusedReason::UnsignedDelete => "unsigned-delete",
            RefusedReason::MarkerLine => "marker-line",
        }
    }
}

impl TrustError {
    /// The refusal this error is when a record fails [`RecordTrust::verify`]; `None` for
    /// the key-file errors, which refuse no record.
    pub fn refused_reason(&self) -> Option<RefusedReason> {
        match self {
            TrustError::Unsigned => Some(RefusedReason::Unsigned),
            TrustError::BadSignature => Some(RefusedReason::BadSignature),
            TrustError::UntrustedKey(_) => Some(RefusedReason::UntrustedKey),
            TrustError::UnsignedDelete => Some(RefusedReason::UnsignedDelete),
            TrustError::Malformed(_) => Some(RefusedReason::MalformedSignature),
            TrustError::KeyFile { .. }
            | TrustError::UnsafeKeyFile { .. }
            | TrustError::NotConfigured => None,
        }
    }
}

/// A record no node may act on: why, as the metrics count it, and the message the log,
/// the status document and the node record carry.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub reason: RefusedReason,
    pub message: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A record an operator signs: a volume record or a snapshot request. Every signature binds
/// the record's place (namespace, variable path, ID), so a signed record copied to another
/// path, namespace or ID does not verify, and a volume's delete signature is no snapshot's.
pub trait Signed {
    /// The record's namespace, variable path and ID.
    fn place(&self) -> (String, String, String);
    /// What the operator signs besides the place, as `(field, value)` in a fixed order.
    fn signed_fields(&self) -> Vec<(&'static str, serde_json::Value)>;
    /// What a delete signature binds besides the place, as `(field, value)` in a fixed
    /// order: the exact record it deletes (none by default).
    fn delete_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        Vec::new()
    }
    /// The record signature and the delete signature (empty when absent).
    fn signatures(&self) -> (&str, &str);
    /// The same, to set them.
    fn signatures_mut(&mut self) -> (&mut String, &mut String);
    /// True when the record asks nodes to delete (acted on only with a delete signature).
    fn deleting(&self) -> bool;
}

impl Signed for VolumeRecord {
    fn place(&self) -> (String, String, String) {
        (
            self.spec.namespace.clone(),
            record_path(&self.spec.name),
            self.id.clone(),
        )
    }
    /// The spec and secrets; for a registered volume also the mark and the context, which
    /// the operator gave (a created volume's context comes from a node and is not signed:
    /// plugins derive its paths from the signed fields).
    fn signed_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        let mut f = vec![
            ("spec", serde_json::json!(self.spec)),
            ("secrets", serde_json::json!(self.secrets)),
        ];
        if self.registered {
            f.push(("registered", true.into()));
            f.push(("context", self.context.clone()));
        }
        f
    }
    /// The context the delete acts on and the variable's CreateIndex: a saved `deleting`
    /// record written back later (a new CreateIndex) or with another context does not verify.
    fn delete_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("context", self.context.clone()),
            ("create_index", self.create_index.into()),
        ]
    }
    fn signatures(&self) -> (&str, &str) {
        (&self.signature, &self.delete_signature)
    }
    fn signatures_mut(&mut self) -> (&mut String, &mut String) {
        (&mut self.signature, &mut self.delete_signature)
    }
    fn deleting(&self) -> bool {
        self.state == VolumeState::Deleting
    }
}

/// The place of `rec` as the first fields of a signed object, after `v` (and `op`).
fn placed(rec: &impl Signed, op: Option<&str>) -> serde_json::Map<String, serde_json::Value> {
    let (namespace, path, id) = rec.place();
    let mut m = serde_json::Map::new();
    m.insert("v".into(), 1.into());
    if let Some(op) = op {
        m.insert("op".into(), op.into());
    }
    m.insert("namespace".into(), namespace.into());
    m.insert("path".into(), path.into());
    m.insert("id".into(), id.into());
    m
}

/// The signed bytes of a record: `{"v":1,"namespace","path","id",<signed fields>}` as
/// compact JSON (a volume's fields are `spec` and `secrets`, plus `registered` and `context`
/// for a registered volume; struct and map fields in a fixed order).
pub fn signed_payload(rec: &impl Signed) -> Vec<u8> {
    let mut m = placed(rec, None);
    for (k, v) in rec.signed_fields() {
        m.insert(k.into(), v);
    }
    serde_json::to_vec(&m).unwrap_or_default()
}

/// The signed bytes of a delete request for a record: `{"v":1,"op":"delete","namespace",
/// "path","id",<delete fields>}` (a volume's and a snapshot's: `context` and `create_index`).
pub fn delete_payload(rec: &impl Signed) -> Vec<u8> {
    let mut m = placed(rec, Some("delete"));
    for (k, v) in rec.delete_fields() {
        m.insert(k.into(), v);
    }
    serde_json::to_vec(&m).unwrap_or_default()
}

/// Decodes a record's variable with `decode` and checks it with `trust`; `Err` says why no
/// node may act on it (it does not decode, or it does not verify).
pub fn admit<R: Signed, E: std::fmt::Display>(
    var: &crate::nomad::types::Variable,
    trust: &RecordTrust,
    decode: impl FnOnce(&crate::nomad::types::Variable) -> Result<R, E>,
) -> Result<R, Refusal> {
    let rec = decode(var).map_err(|e| Refusal {
        reason: RefusedReason::Malformed,
        message: e.to_string(),
    })?;
    trust.verify(&rec).map_err(|e| Refusal {
        reason: e.refused_reason().unwrap_or(RefusedReason::BadSignature),
        message: format!(
            "variable {} in namespace {} is not acted on: {e}",
            var.path, var.namespace
        ),
    })?;
    Ok(rec)
}

/// An operator's signing key (the CLI's `--signing-key`).
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey({})", key_id(self.pair.public_key().as_ref()))
    }
}

/// Short ID of a public key: the first 8 bytes of its SHA-256, hex.
pub fn key_id(public: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, public);
    d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl SigningKey {
    /// A new random key. Returns the key and its private key file text.
    pub fn generate() -> Result<(Self, String), TrustError> {
        let rng = ring::rand::SystemRandom::new();
        let doc = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| TrustError::KeyFile {
            path: "(new key)".into(),
            reason: "the system random generator failed".into(),
        })?;
        let text = format!("ed25519-private {}\n", B64.encode(doc.as_ref()));
        let key = Self::parse(&text, "(new key)")?;
        Ok((key, text))
    }

    /// Parses a private key file's text.
    pub fn parse(text: &str, path: &str) -> Result<Self, TrustError> {
        let bad = |reason: &str| TrustError::KeyFile {
            path: path.into(),
            reason: reason.into(),
        };
        let b64 = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .and_then(|l| l.strip_prefix("ed25519-private "))
            .ok_or_else(|| bad("expected a line `ed25519-private <base64>`"))?;
        let der = B64
            .decode(b64.trim())
            .map_err(|_| bad("the key is not base64"))?;
        let pair = Ed25519KeyPair::from_pkcs8(&der)
            .or_else(|_| Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der))
            .map_err(|_| bad("not an Ed25519 PKCS#8 key"))?;
        Ok(Self { pair })
    }

    /// Reads a private key file. It must not be readable by group or others.
    pub fn load(path: &Path) -> Result<Self, TrustError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| TrustError::KeyFile {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(TrustError::KeyFile {
                path: shown,
                reason: format!(
                    "mode {:o} lets others read the private key: chmod 600 it",
                    meta.permissions().mode() & 0o777
                ),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|e| TrustError::KeyFile {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        Self::parse(&text, &shown)
    }

    /// The public key file line for this key: `ed25519 <base64>`.
    pub fn public_line(&self) -> String {
        format!("ed25519 {}", B64.encode(self.pair.public_key().as_ref()))
    }

    fn sign_bytes(&self, msg: &[u8]) -> String {
        format!(
            "{SIG_PREFIX}{}:{}",
            key_id(self.pair.public_key().as_ref()),
            B64.encode(self.pair.sign(msg).as_ref())
        )
    }

    /// Sets the record's signature over [`signed_payload`].
    pub fn sign(&self, rec: &mut impl Signed) {
        let sig = self.sign_bytes(&signed_payload(rec));
        *rec.signatures_mut().0 = sig;
    }

    /// Sets the record's delete signature over [`delete_payload`].
    pub fn sign_delete(&self, rec: &mut impl Signed) {
        let sig = self.sign_bytes(&delete_payload(rec));
        *rec.signatures_mut().1 = sig;
    }
}

/// What this node trusts: operator public keys, or (test clusters only) every record.
#[derive(Debug, Clone)]
pub enum RecordTrust {
    /// Records must carry a signature by one of these Ed25519 public keys (32 bytes each).
    Keys(Vec<Vec<u8>>),
    /// Every record is acted on (`--allow-unsigned-records`): anyone who may write variables
    /// under `dhv-binder/volumes/` may then make nodes mount and delete as root.
    Unverified,
}

/// Reads a record-keys file, refusing it ([`TrustError::UnsafeKeyFile`]) unless it is owned
/// by root or the agent's own uid and writable by neither group nor others. The checks are
/// made on the opened file, so the file read is the file checked.
fn read_key_file(p: &Path) -> Result<String, TrustError> {
    use std::io::Read as _;
    use std::os::unix::fs::MetadataExt as _;
    let shown = p.display().to_string();
    let io = |e: std::io::Error| TrustError::KeyFile {
        path: shown.clone(),
        reason: e.to_string(),
    };
    let mut f = std::fs::File::open(p).map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    let me = nix::unistd::geteuid().as_raw();
    let unsafe_file = |reason: String| TrustError::UnsafeKeyFile {
        path: shown.clone(),
        reason,
    };
    if meta.uid() != 0 && meta.uid() != me {
        return Err(unsafe_file(format!(
            "owned by uid {}, not root (or the agent's uid {me})",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(unsafe_file(format!(
            "mode {:o} lets group or others write it",
            meta.mode() & 0o7777
        )));
    }
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(io)?;
    Ok(text)
}

impl RecordTrust {
    /// Parses a public key file's text.
    pub fn parse_keys(text: &str, path: &str) -> Result<Self, TrustError> {
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: &str| TrustError::KeyFile {
                path: path.into(),
                reason: format!("line {}: {reason}", n + 1),
            };
            let b64 = line
                .strip_prefix("ed25519 ")
                .ok_or_else(|| bad("expected `ed25519 <base64 public key>`"))?;
            let key = B64
                .decode(b64.trim())
                .map_err(|_| bad("the key is not base64"))?;
            if key.len() != 32 {
                return Err(bad("an Ed25519 public key is 32 bytes"));
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(TrustError::KeyFile {
                path: path.into(),
                reason: "no key in the file".into(),
            });
        }
        Ok(RecordTrust::Keys(keys))
    }

    /// The trust of an agent: keys from `record_keys`, or [`RecordTrust::Unverified`] when
    /// only `allow_unsigned` is given; neither is [`TrustError::NotConfigured`] (fail closed).
    pub fn from_settings(
        record_keys: Option<&Path>,
        allow_unsigned: bool,
    ) -> Result<Self, TrustError> {
        match (record_keys, allow_unsigned) {
            (Some(p), _) => {
                let shown = p.display().to_string();
                let text = read_key_file(p)?;
                Self::parse_keys(&text, &shown)
            }
            (None, true) => Ok(RecordTrust::Unverified),
            (None, false) => Err(TrustError::NotConfigured),
        }
    }

    fn verify_bytes(&self, keys: &[Vec<u8>], msg: &[u8], sig: &str) -> Result<(), TrustError> {
        if sig.is_empty() {
            return Err(TrustError::Unsigned);
        }
        let rest = sig
            .strip_prefix(SIG_PREFIX)
            .ok_or_else(|| TrustError::Malformed(sig.chars().take(40).collect()))?;
        let (kid, b64) = rest
            .split_once(':')
            .ok_or_else(|| TrustError::Malformed(sig.chars().take(40).collect()))?;
        let raw = B64
            .decode(b64)
            .map_err(|_| TrustError::Malformed(sig.chars().take(40).collect()))?;
        let mut named = keys.iter().filter(|k| key_id(k) == kid).peekable();
        if named.peek().is_none() {
            return Err(TrustError::UntrustedKey(crate::escape::escape_control(
                &kid.chars().take(40).collect::<String>(),
            )));
        }
        let ok = named.any(|k| {
            UnparsedPublicKey::new(&ED25519, k)
                .verify(msg, &raw)
                .is_ok()
        });
        if ok {
            Ok(())
        } else {
            Err(TrustError::BadSignature)
        }
    }

    /// Checks that a record may be acted on: its signature covers its ID, place and signed
    /// fields (a volume's spec and secrets, a snapshot's source), and a `deleting` state
    /// carries a valid delete signature.
    pub fn verify(&self, rec: &impl Signed) -> Result<(), TrustError> {
        let RecordTrust::Keys(keys) = self else {
            return Ok(());
        };
        let (signature, delete_signature) = rec.signatures();
        self.verify_bytes(keys, &signed_payload(rec), signature)?;
        if rec.deleting() {
            self.verify_bytes(keys, &delete_payload(rec), delete_signature)
                .map_err(|_| TrustError::UnsignedDelete)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::parse_spec;

    fn record() -> VolumeRecord {
        let (spec, secrets) = parse_spec(
            "name = \"data\"\nplugin_id = \"bind\"\nparameters { export = \"/srv/exports\" }\nsecrets { password = \"pw\" }\nsecret_ref \"token\" {\n variable = \"dhv-binder-secrets/data\"\n item = \"token\"\n}",
        )
        .unwrap();
        VolumeRecord::new(spec, secrets)
    }

    fn trust_of(k: &SigningKey) -> RecordTrust {
        RecordTrust::parse_keys(&k.public_line(), "keys").unwrap()
    }

    #[test]
    fn signed_records_verify_and_every_signed_field_is_bound() {
        let (key, text) = SigningKey::generate().unwrap();
        let key2 = SigningKey::parse(&text, "k").unwrap();
        let trust = trust_of(&key);
        let mut rec = record();
        assert_eq!(trust.verify(&rec), Err(TrustError::Unsigned));
        key2.sign(&mut rec);
        assert_eq!(trust.verify(&rec), Ok(()));
        // What a node writes back is not signed.
        rec.context = serde_json::json!({"export_path": "/srv/exports/default/x"});
        rec.state = VolumeState::Ready;
        assert_eq!(trust.verify(&rec), Ok(()));
        let tamper: [fn(&mut VolumeRecord); 7] = [
            // A reference moved to another variable: a secret the operator did not name.
            |r| {
                r.spec.secret_refs.insert(
                    "token".into(),
                    crate::volume::secret_refs::SecretRef::Variable {
                        path: "dhv-binder-secrets/other".into(),
                        item: "token".into(),
                    },
                );
            },
            |r| {
                r.spec.parameters.insert("export".into(), "/".into());
            },
            |r| {
                r.secrets.insert("password".into(), "other".into());
            },
            |r| r.spec.namespace = "other".into(),
            |r| r.spec.name = "other".into(),
            |r| r.id = uuid::Uuid::new_v4().to_string(),
            |r| r.spec.plugin_id = "ext4".into(),
        ];
        for t in tamper {
            let mut bad = rec.clone();
            t(&mut bad);
            assert_eq!(trust.verify(&bad), Err(TrustError::BadSignature));
        }
        // Another operator's key is not trusted, and the refusal names it (issue 37 #13:
        // an untrusted key is told apart from an altered record).
        let (other, _) = SigningKey::generate().unwrap();
        let mut foreign = record();
        other.sign(&mut foreign);
        let kid = key_id(other.pair.public_key().as_ref());
        assert_eq!(
            trust.verify(&foreign),
            Err(TrustError::UntrustedKey(kid.clone()))
        );
        // Whole within a node record's 200 characters (`volume status`, `volume create`).
        let shown = TrustError::UntrustedKey(kid.clone()).to_string();
        assert!(shown.contains(&kid), "{shown}");
        assert!(shown.chars().count() <= 200, "{shown}");
    }

    /// Issue 37 #13: each refusal of a record is one of the closed set of reasons the
    /// metrics count, whatever makes it.
    #[test]
    fn every_refusal_has_its_reason() {
        let (key, _) = SigningKey::generate().unwrap();
        let trust = trust_of(&key);
        let stored = |r: &VolumeRecord| r.to_variable();
        let reason = |r: &VolumeRecord| {
            admit(&stored(r), &trust, VolumeRecord::from_variable)
                .err()
                .map(|e| e.reason)
        };
        let mut rec = record();
        assert_eq!(reason(&rec), Some(RefusedReason::Unsigned));
        rec.signature = "rsa:nonsense".into();
        assert_eq!(reason(&rec), Some(RefusedReason::MalformedSignature));
        let (other, _) = SigningKey::generate().unwrap();
        other.sign(&mut rec);
        assert_eq!(reason(&rec), Some(RefusedReason::UntrustedKey));
        key.sign(&mut rec);
        assert_eq!(reason(&rec), None);
        let mut altered = rec.clone();
        altered.secrets.insert("password".into(), "other".into());
        assert_eq!(reason(&altered), Some(RefusedReason::BadSignature));
        let mut deleting = rec.clone();
        deleting.state = VolumeState::Deleting;
        assert_eq!(reason(&deleting), Some(RefusedReason::UnsignedDelete));
        let mut var = stored(&rec);
        var.items.insert("spec".into(), "{not json".into());
        let e = admit(&var, &trust, VolumeRecord::from_variable).unwrap_err();
        assert_eq!(e.reason, RefusedReason::Malformed);
        let labels: std::collections::BTreeSet<&str> =
            RefusedReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), RefusedReason::ALL.len());
    }

    #[test]
    fn a_created_volume_payload_is_the_same_bytes_as_before_snapshots_were_signed() {
        // Created volumes' records signed by an earlier CLI must still verify.
        let rec = record();
        let before = serde_json::to_vec(&serde_json::json!({
            "v": 1,
            "namespace": rec.spec.namespace,
            "path": record_path(&rec.spec.name),
            "id": rec.id,
            "spec": rec.spec,
            "secrets": rec.secrets,
        }))
        .unwrap();
        assert_eq!(signed_payload(&rec), before);
        let mut rec = rec;
        rec.context = serde_json::json!({"export_path": "/srv/exports/default/x"});
        rec.create_index = 42;
        let delete = serde_json::to_vec(&serde_json::json!({
            "v": 1,
            "op": "delete",
            "namespace": rec.spec.namespace,
            "path": record_path(&rec.spec.name),
            "id": rec.id,
            "context": rec.context,
            "create_index": 42,
        }))
        .unwrap();
        assert_eq!(delete_payload(&rec), delete);
    }

    #[test]
    fn a_registered_volume_signs_its_context_and_the_mark() {
        let (key, _) = SigningKey::generate().unwrap();
        let trust = trust_of(&key);
        let mut rec = record();
        rec.registered = true;
        rec.context = serde_json::json!({"export_path": "/srv/exports/mine"});
        key.sign(&mut rec);
        assert_eq!(trust.verify(&rec), Ok(()));
        // A Variables writer re-points the context, or drops or adds the mark: refused.
        let mut moved = rec.clone();
        moved.context = serde_json::json!({"export_path": "/srv/exports/prod/"});
        assert_eq!(trust.verify(&moved), Err(TrustError::BadSignature));
        let mut unmarked = rec.clone();
        unmarked.registered = false;
        assert_eq!(trust.verify(&unmarked), Err(TrustError::BadSignature));
        let mut created = record();
        key.sign(&mut created);
        created.registered = true;
        assert_eq!(trust.verify(&created), Err(TrustError::BadSignature));
    }

    #[test]
    fn a_delete_signature_binds_the_exact_record() {
        let (key, _) = SigningKey::generate().unwrap();
        let trust = trust_of(&key);
        let mut rec = record();
        key.sign(&mut rec);
        rec.context = serde_json::json!({"export_path": "/srv/exports/default/dev"});
        rec.create_index = 7;
        rec.state = VolumeState::Deleting;
        key.sign_delete(&mut rec);
        assert_eq!(trust.verify(&rec), Ok(()));
        // Written back with another context, or written again later (a new CreateIndex).
        let mut other_context = rec.clone();
        other_context.context = serde_json::json!({"export_path": "/srv/exports/default/prod"});
        assert_eq!(
            trust.verify(&other_context),
            Err(TrustError::UnsignedDelete)
        );
        let mut rewritten = rec.clone();
        rewritten.create_index = 90;
        assert_eq!(trust.verify(&rewritten), Err(TrustError::UnsignedDelete));
    }

    #[test]
    fn deleting_needs_its_own_signature() {
        let (key, _) = SigningKey::generate().unwrap();
        let trust = trust_of(&key);
        let mut rec = record();
        key.sign(&mut rec);
        rec.state = VolumeState::Deleting;
        assert_eq!(trust.verify(&rec), Err(TrustError::UnsignedDelete));
        // The record signature is not a delete signature.
        rec.delete_signature = rec.signature.clone();
        assert_eq!(trust.verify(&rec), Err(TrustError::UnsignedDelete));
        key.sign_delete(&mut rec);
        assert_eq!(trust.verify(&rec), Ok(()));
        // A delete signature of another volume does not carry over.
        let mut other = record();
        key.sign(&mut other);
        other.state = VolumeState::Deleting;
        other.delete_signature = rec.delete_signature.clone();
        assert_eq!(trust.verify(&other), Err(TrustError::UnsignedDelete));
    }

    /// Issue 33: a record-keys file another user could write is refused, with what to run.
    #[test]
    fn a_key_file_others_can_write_or_own_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let (key, _) = SigningKey::generate().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("record-keys.pub");
        std::fs::write(&p, key.public_line()).unwrap();
        let mode =
            |m: u32| std::fs::set_permissions(&p, std::fs::Permissions::from_mode(m)).unwrap();
        mode(0o644);
        assert!(matches!(
            RecordTrust::from_settings(Some(&p), false),
            Ok(RecordTrust::Keys(_))
        ));
        for m in [0o664, 0o646, 0o666, 0o620] {
            mode(m);
            let e = RecordTrust::from_settings(Some(&p), false).unwrap_err();
            assert!(
                matches!(e, TrustError::UnsafeKeyFile { .. }),
                "{m:o}: {e:?}"
            );
            let text = e.to_string();
            assert!(
                text.contains(&format!("chmod go-w {}", p.display())),
                "{text}"
            );
        }
        mode(0o600);
        assert!(RecordTrust::from_settings(Some(&p), false).is_ok());
        // Owned by another user (tests run as root, so `nobody` is neither root nor us).
        std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
        let e = RecordTrust::from_settings(Some(&p), false).unwrap_err();
        assert!(matches!(e, TrustError::UnsafeKeyFile { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains(&format!("chown root {}", p.display())),
            "{e}"
        );
    }

    #[test]
    fn settings_fail_closed_and_key_files_are_checked() {
        assert_eq!(
            RecordTrust::from_settings(None, false).unwrap_err(),
            TrustError::NotConfigured
        );
        assert!(matches!(
            RecordTrust::from_settings(None, true),
            Ok(RecordTrust::Unverified)
        ));
        assert!(RecordTrust::from_settings(Some(Path::new("/nonexistent/keys")), true).is_err());
        for bad in [
            "",
            "# only a comment",
            "rsa AAAA",
            "ed25519 !!!",
            "ed25519 AAAA",
        ] {
            assert!(RecordTrust::parse_keys(bad, "k").is_err(), "{bad:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let (_, text) = SigningKey::generate().unwrap();
        let p = dir.path().join("op.key");
        std::fs::write(&p, text).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = SigningKey::load(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(SigningKey::load(&p).is_ok());
        for sig in ["ed25519:nokid", "rsa:x:y", "ed25519:ab:%%%"] {
            let mut rec = record();
            rec.signature = sig.into();
            let trust = RecordTrust::Keys(vec![vec![0; 32]]);
            assert!(
                matches!(trust.verify(&rec), Err(TrustError::Malformed(_))),
                "{sig}"
            );
        }
    }
}
