//! A volume's secrets by reference (issue 49): the spec names where each secret lives
//! instead of holding it, and the node's agent reads it at the moment a plugin call needs
//! it (`storage::secrets`). The signed record stores only the references.
//!
//! ```hcl
//! secret_ref "password" {          # the key the plugin sees in DHV_SECRETS
//!   variable = "dhv-binder-secrets/webdav"   # a Nomad Variable in the volume's namespace
//!   item     = "password"                    # one of its items
//! }
//! secret_ref "token" {
//!   vault = "secret/webdav"        # a Vault KV v2 secret: mount "secret", path "webdav"
//!   field = "token"                # one of its fields
//! }
//! ```
//!
//! Inline `secrets { }` keep working; they are stored in the record (the weaker choice,
//! docs/security.md "Secrets").

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The most references one spec may hold.
const MAX_REFS: usize = 32;

/// Where one secret lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SecretRef {
    /// Item `item` of the Nomad Variable `path` in the volume's namespace, read with the
    /// node agent's own token.
    Variable { path: String, item: String },
    /// Field `field` of the Vault KV v2 secret `path` (`<mount>/<path in the mount>`), read
    /// with the node's Vault token.
    Vault { path: String, field: String },
}

impl SecretRef {
    /// `variable <path>#<item>` or `vault <path>#<field>`, for messages (never a value).
    pub fn describe(&self) -> String {
        match self {
            SecretRef::Variable { path, item } => format!("variable {path}#{item}"),
            SecretRef::Vault { path, field } => format!("vault {path}#{field}"),
        }
    }
}

/// A `secret_ref` block that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretRefError {
    #[error("secret_ref needs one label, the secret's name: `secret_ref \"password\" {{ variable = \"…\" item = \"…\" }}`")]
    Label,
    #[error("secret_ref {name:?}: the name may use letters, digits, '_', '.', '-' (at most 100)")]
    BadName { name: String },
    #[error("secret_ref {name:?} is given twice")]
    Twice { name: String },
    #[error("secret {name:?} is both inline (secrets {{ }}) and a secret_ref: keep one")]
    AlsoInline { name: String },
    #[error("secret_ref {name:?} must hold either `variable` and `item` (a Nomad Variable) or `vault` and `field` (a Vault KV v2 secret), as strings, and nothing else")]
    Shape { name: String },
    #[error("secret_ref {name:?}: variable path {path:?} is not a Nomad Variable path (letters, digits, '-', '_', '~', '/'-separated, at most 128 characters)")]
    BadVariablePath { name: String, path: String },
    #[error("secret_ref {name:?}: variable path {path:?} is under dhv-binder/, where the records live and every reader of them would see it; keep secrets under their own prefix (the agent's --secrets-path, default dhv-binder-secrets/)")]
    UnderRecords { name: String, path: String },
    #[error("secret_ref {name:?}: vault path {path:?} must be `<mount>/<path>` of letters, digits, '-', '_', '.', '/'-separated (no '..')")]
    BadVaultPath { name: String, path: String },
    #[error("secret_ref {name:?}: {field} {value:?} may use letters, digits, '_', '.', '-' (at most 100)")]
    BadKey {
        name: String,
        field: &'static str,
        value: String,
    },
    #[error("a spec may hold at most {MAX_REFS} secret_ref blocks")]
    TooMany,
}

fn is_key(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 100
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// A Nomad Variable path as Nomad takes it (`^[a-zA-Z0-9-_~/]{1,128}$`,
/// `nomad/structs/variables.go` `validVariablePath`), without empty segments.
fn is_variable_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 128
        && p.split('/').all(|s| !s.is_empty())
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~' | b'/'))
}

fn is_vault_path(p: &str) -> bool {
    p.len() <= 512
        && p.split('/').count() >= 2
        && p.split('/').all(|s| {
            !s.is_empty()
                && s != "."
                && s != ".."
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        })
}

/// The `secret_ref "<name>" { … }` blocks of a spec's HCL `body`, checked; `inline` are the
/// spec's inline secrets (a name may not be both).
pub fn parse(
    body: &hcl::edit::structure::Body,
    inline: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, SecretRef>, SecretRefError> {
    use hcl::edit::expr::Expression;
    use hcl::edit::structure::Structure;
    let mut out = BTreeMap::new();
    for b in body.iter().filter_map(Structure::as_block) {
        if b.ident.as_str() != "secret_ref" {
            continue;
        }
        let [label] = b.labels.as_slice() else {
            return Err(SecretRefError::Label);
        };
        let name = label.as_str().to_string();
        if !is_key(&name) {
            return Err(SecretRefError::BadName { name });
        }
        let mut fields = BTreeMap::new();
        for inner in b.body.iter() {
            match inner {
                Structure::Attribute(a) => match &a.value {
                    Expression::String(s) => {
                        fields.insert(a.key.as_str().to_string(), s.value().to_string());
                    }
                    _ => return Err(SecretRefError::Shape { name }),
                },
                Structure::Block(_) => return Err(SecretRefError::Shape { name }),
            }
        }
        let get = |k: &str| fields.get(k).cloned();
        let r = match (
            fields.len(),
            get("variable"),
            get("item"),
            get("vault"),
            get("field"),
        ) {
            (2, Some(path), Some(item), None, None) => {
                if !is_variable_path(&path) {
                    return Err(SecretRefError::BadVariablePath { name, path });
                }
                if path == "dhv-binder" || path.starts_with("dhv-binder/") {
                    return Err(SecretRefError::UnderRecords { name, path });
                }
                if !is_key(&item) {
                    return Err(SecretRefError::BadKey {
                        name,
                        field: "item",
                        value: item,
                    });
                }
                SecretRef::Variable { path, item }
            }
            (2, None, None, Some(path), Some(field)) => {
                if !is_vault_path(&path) {
                    return Err(SecretRefError::BadVaultPath { name, path });
                }
                if !is_key(&field) {
                    return Err(SecretRefError::BadKey {
                        name,
                        field: "field",
                        value: field,
                    });
                }
                SecretRef::Vault { path, field }
            }
            _ => return Err(SecretRefError::Shape { name }),
        };
        if inline.contains_key(&name) {
            return Err(SecretRefError::AlsoInline { name });
        }
        if out.insert(name.clone(), r).is_some() {
            return Err(SecretRefError::Twice { name });
        }
        if out.len() > MAX_REFS {
            return Err(SecretRefError::TooMany);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(text: &str) -> Result<BTreeMap<String, SecretRef>, SecretRefError> {
        let body = hcl::edit::parser::parse_body(text).unwrap();
        parse(&body, &BTreeMap::from([("inline".into(), "x".into())]))
    }

    #[test]
    fn references_name_a_variable_item_or_a_vault_field() {
        let r = refs(
            "secret_ref \"password\" {\n variable = \"dhv-binder-secrets/webdav\"\n item = \"password\"\n}\nsecret_ref \"token\" {\n vault = \"secret/team/webdav\"\n field = \"token\"\n}\n",
        )
        .unwrap();
        assert_eq!(
            r["password"],
            SecretRef::Variable {
                path: "dhv-binder-secrets/webdav".into(),
                item: "password".into()
            }
        );
        assert_eq!(
            r["token"],
            SecretRef::Vault {
                path: "secret/team/webdav".into(),
                field: "token".into()
            }
        );
    }

    #[test]
    fn bad_references_are_refused_by_name() {
        let cases = [
            (
                "secret_ref {\n variable = \"a\"\n item = \"b\"\n}",
                "one label",
            ),
            ("secret_ref \"p\" {\n variable = \"a\"\n}", "either"),
            (
                "secret_ref \"p\" {\n variable = \"a\"\n item = \"b\"\n field = \"c\"\n}",
                "either",
            ),
            (
                "secret_ref \"p\" {\n variable = \"dhv-binder/volumes/x\"\n item = \"b\"\n}",
                "under dhv-binder/",
            ),
            (
                "secret_ref \"p\" {\n variable = \"a/../b\"\n item = \"b\"\n}",
                "not a Nomad Variable path",
            ),
            (
                "secret_ref \"p\" {\n vault = \"secret/../sys\"\n field = \"b\"\n}",
                "vault path",
            ),
            (
                "secret_ref \"p\" {\n vault = \"nomount\"\n field = \"b\"\n}",
                "vault path",
            ),
            (
                "secret_ref \"inline\" {\n variable = \"a\"\n item = \"b\"\n}",
                "both inline",
            ),
            (
                "secret_ref \"p\" {\n variable = \"a\"\n item = \"b c\"\n}",
                "item",
            ),
        ];
        for (text, want) in cases {
            let e = refs(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
