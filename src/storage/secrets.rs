//! A volume's secrets read where they live, at the moment a plugin call needs them
//! (issue 49): the spec's `secret_ref` blocks ([`crate::volume::secret_refs`]) name a Nomad
//! Variable item in the volume's namespace, read with the node agent's own token, or a Vault
//! KV v2 field, read with the node's Vault token. Nothing is cached: a changed value is used
//! by the next call (rotation without a re-create). The values go only to the plugin's
//! `DHV_SECRETS` and to the redaction of what the call prints (`storage::redact`); never to a
//! record, the journal, a log line, status or a metric.
//!
//! The node reads only under its own secrets path (`--secrets-path`, default
//! `dhv-binder-secrets/`), the one its ACL policy grants `read` on
//! (jobspecs/dhv-binder-policy.hcl): a reference elsewhere is refused here by name, before
//! any request, whatever the token could read.

use crate::nomad::{Client, NomadError};
use crate::volume::secret_refs::SecretRef;
use crate::volume::VolumeRecord;
use std::collections::BTreeMap;
use std::time::Duration;

/// The default `--secrets-path`.
pub const DEFAULT_SECRETS_PATH: &str = "dhv-binder-secrets/";

/// The longest a Vault read may take.
const VAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest Vault answer read (a KV secret is small).
const VAULT_MAX_BODY: usize = 1 << 20;

/// A secret reference that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret {name:?} ({place}) is outside this node's secrets path {allowed:?}: move the variable under it, or start the agent with --secrets-path naming its prefix (and grant the agent's policy read there, jobspecs/dhv-binder-policy.hcl)")]
    Outside {
        name: String,
        place: String,
        allowed: String,
    },
    #[error("secret {name:?}: variable {path} does not exist in namespace {namespace:?}: write it (`nomad var put -namespace {namespace} {path} {item}=…`)")]
    Missing {
        name: String,
        namespace: String,
        path: String,
        item: String,
    },
    #[error("secret {name:?}: {place} has no {key:?}: add it there")]
    NoItem {
        name: String,
        place: String,
        key: String,
    },
    #[error("secret {name:?}: cannot read variable {path} in namespace {namespace:?} (the agent's policy must grant read on it): {source}")]
    Nomad {
        name: String,
        namespace: String,
        path: String,
        #[source]
        source: NomadError,
    },
    #[error("secret {name:?} lives in Vault ({path}) but this node has no Vault configured: start the agent with VAULT_ADDR and VAULT_TOKEN (or --vault-addr, --vault-token)")]
    NoVault { name: String, path: String },
    #[error("secret {name:?}: Vault read of {path} failed: {reason}")]
    Vault {
        name: String,
        path: String,
        reason: String,
    },
    #[error("secrets are referenced but this node reads none (no secret source configured)")]
    NoSource,
}

impl SecretError {
    /// True when trying again later may succeed (Nomad or Vault unreachable, a variable
    /// not written yet); false for a reference this node will never read.
    pub fn is_transient(&self) -> bool {
        !matches!(self, SecretError::Outside { .. } | SecretError::NoSource)
    }
}

/// The node's Vault: its address and token (`VAULT_ADDR`, `VAULT_TOKEN` conventions).
#[derive(Clone)]
pub struct Vault {
    addr: reqwest::Url,
    token: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for Vault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vault")
            .field("addr", &self.addr.as_str())
            .finish_non_exhaustive()
    }
}

/// A Vault setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum VaultSettingError {
    #[error("--vault-addr {0:?} is not an http(s) URL")]
    BadAddress(String),
    #[error("--vault-addr {0:?} is plain http to another host: the Vault token would cross the network in clear; use https (http only on loopback)")]
    Cleartext(String),
    #[error("cannot make the Vault HTTP client: {0}")]
    Client(#[source] reqwest::Error),
}

impl Vault {
    /// The Vault at `addr` (`https://…`, or `http://` on loopback only), read with `token`.
    pub fn new(addr: &str, token: String) -> Result<Self, VaultSettingError> {
        let url = reqwest::Url::parse(addr)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
            .ok_or_else(|| VaultSettingError::BadAddress(addr.into()))?;
        if url.scheme() == "http" && !crate::nomad::is_loopback(addr) {
            return Err(VaultSettingError::Cleartext(addr.into()));
        }
        let http = reqwest::Client::builder()
            .timeout(VAULT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(VaultSettingError::Client)?;
        Ok(Self {
            addr: url,
            token,
            http,
        })
    }

    /// Vault API (KV secrets engine version 2, "Read secret version"):
    /// `GET /v1/:mount/data/:path` with `X-Vault-Token`; the answer is
    /// `{"data":{"data":{"<field>":"<value>",…},"metadata":{"version":N,…}}}`, 404 for a
    /// path without a secret. `path` is `<mount>/<path in the mount>`; the URL is built from
    /// its percent-encoded segments. Every field must be a string.
    pub async fn read_kv2(&self, path: &str) -> Result<Option<BTreeMap<String, String>>, String> {
        let mut url = self.addr.clone();
        let (mount, rest) = path.split_once('/').ok_or("no mount in the path")?;
        {
            let mut segs = url
                .path_segments_mut()
                .map_err(|_| "the address cannot take a path".to_string())?;
            segs.pop_if_empty().push("v1").push(mount).push("data");
            for s in rest.split('/') {
                segs.push(s);
            }
        }
        let resp = self
            .http
            .get(url)
            .header("X-Vault-Token", &self.token)
            .send()
            .await
            .map_err(|e| format!("cannot reach Vault: {}", e.without_url()))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            // Vault's own error text is not shown: it is the server's, not ours to trust.
            return Err(format!(
                "Vault answered {status} (403: the node's token may not read it)"
            ));
        }
        if resp
            .content_length()
            .is_some_and(|n| n > VAULT_MAX_BODY as u64)
        {
            return Err("Vault's answer is too large".into());
        }
        let body = resp
            .bytes()
            .await
            .map_err(|e| format!("cannot read Vault's answer: {}", e.without_url()))?;
        if body.len() > VAULT_MAX_BODY {
            return Err("Vault's answer is too large".into());
        }
        #[derive(serde::Deserialize)]
        struct Outer {
            data: Inner,
        }
        #[derive(serde::Deserialize)]
        struct Inner {
            data: Option<BTreeMap<String, serde_json::Value>>,
        }
        let outer: Outer = serde_json::from_slice(&body)
            .map_err(|_| "Vault's answer is not a KV v2 read (is the mount KV version 2?)")?;
        // A deleted version answers `"data": null`.
        let Some(fields) = outer.data.data else {
            return Ok(None);
        };
        fields
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => Ok((k, s)),
                _ => Err(format!("field {k:?} is not a string")),
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }
}

/// A secrets setting of the agent that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SettingError {
    #[error("--secrets-path {0:?} is not a Nomad Variable path prefix (letters, digits, '-', '_', '~', '/')")]
    BadPath(String),
    #[error("--secrets-path {0:?} is under dhv-binder/, where the records live (every reader of the records could read the secrets): use a prefix of its own, such as dhv-binder-secrets/")]
    UnderRecords(String),
    #[error("--vault-addr is set without VAULT_TOKEN (or --vault-token): set both, or neither")]
    NoVaultToken,
    #[error(transparent)]
    Vault(#[from] VaultSettingError),
}

/// Where this node reads referenced secrets from.
#[derive(Clone, Debug)]
pub struct SecretSource {
    client: Client,
    /// The prefix every referenced variable path must start with (ends with `/`).
    path: String,
    vault: Option<Vault>,
}

impl SecretSource {
    /// Reads variables under `path` (a prefix; a `/` is added when missing) with `client`'s
    /// token, and Vault secrets from `vault` when the node has one.
    pub fn new(client: Client, path: &str, vault: Option<Vault>) -> Self {
        let mut path = path.to_string();
        if !path.ends_with('/') {
            path.push('/');
        }
        Self {
            client,
            path,
            vault,
        }
    }

    /// The source from the agent's settings: `--secrets-path` (checked), and Vault when
    /// `vault_addr` is set (then `vault_token` must be).
    pub fn from_settings(
        client: Client,
        path: &str,
        vault_addr: Option<&str>,
        vault_token: Option<String>,
    ) -> Result<Self, SettingError> {
        let bare = path.trim_end_matches('/');
        let ok = !bare.is_empty()
            && bare.len() < 128
            && bare.split('/').all(|s| !s.is_empty())
            && bare
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~' | b'/'));
        if !ok {
            return Err(SettingError::BadPath(path.into()));
        }
        if bare == "dhv-binder" || bare.starts_with("dhv-binder/") {
            return Err(SettingError::UnderRecords(path.into()));
        }
        let vault = match (vault_addr.filter(|a| !a.is_empty()), vault_token) {
            (None, _) => None,
            (Some(_), None) => return Err(SettingError::NoVaultToken),
            (Some(addr), Some(token)) => Some(Vault::new(addr, token)?),
        };
        Ok(Self::new(client, bare, vault))
    }

    /// The volume's secrets for one plugin call: its inline `secrets` and every reference
    /// read now (each variable or Vault path once).
    pub async fn resolve(
        &self,
        rec: &VolumeRecord,
    ) -> Result<BTreeMap<String, String>, SecretError> {
        self.resolve_refs(&rec.spec.namespace, &rec.secrets, &rec.spec.secret_refs)
            .await
    }

    /// `inline` and every one of `refs` read now, variables in `namespace`.
    pub async fn resolve_refs(
        &self,
        namespace: &str,
        inline: &BTreeMap<String, String>,
        refs: &BTreeMap<String, SecretRef>,
    ) -> Result<BTreeMap<String, String>, SecretError> {
        let mut out = inline.clone();
        let namespace = &namespace.to_string();
        let mut variables: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
        let mut vault: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
        for (name, r) in refs {
            let value = match r {
                SecretRef::Variable { path, item } => {
                    if !path.starts_with(&self.path) {
                        return Err(SecretError::Outside {
                            name: name.clone(),
                            place: r.describe(),
                            allowed: self.path.clone(),
                        });
                    }
                    if !variables.contains_key(path.as_str()) {
                        let v = self
                            .client
                            .variable(namespace, path)
                            .await
                            .map_err(|source| SecretError::Nomad {
                                name: name.clone(),
                                namespace: namespace.clone(),
                                path: path.clone(),
                                source,
                            })?
                            .ok_or_else(|| SecretError::Missing {
                                name: name.clone(),
                                namespace: namespace.clone(),
                                path: path.clone(),
                                item: item.clone(),
                            })?;
                        variables.insert(path, v.items);
                    }
                    variables[path.as_str()].get(item).cloned().ok_or_else(|| {
                        SecretError::NoItem {
                            name: name.clone(),
                            place: format!("variable {path} in namespace {namespace:?}"),
                            key: item.clone(),
                        }
                    })?
                }
                SecretRef::Vault { path, field } => {
                    let Some(v) = &self.vault else {
                        return Err(SecretError::NoVault {
                            name: name.clone(),
                            path: path.clone(),
                        });
                    };
                    if !vault.contains_key(path.as_str()) {
                        let fields = v
                            .read_kv2(path)
                            .await
                            .map_err(|reason| SecretError::Vault {
                                name: name.clone(),
                                path: path.clone(),
                                reason,
                            })?
                            .ok_or_else(|| SecretError::Vault {
                                name: name.clone(),
                                path: path.clone(),
                                reason: "no such secret (404)".into(),
                            })?;
                        vault.insert(path, fields);
                    }
                    vault[path.as_str()]
                        .get(field)
                        .cloned()
                        .ok_or_else(|| SecretError::NoItem {
                            name: name.clone(),
                            place: format!("Vault secret {path}"),
                            key: field.clone(),
                        })?
                }
            };
            out.insert(name.clone(), value);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A loopback fake of Vault's KV v2 read endpoint (`GET /v1/secret/data/<path>`,
    /// developer.hashicorp.com/vault/api-docs/secret/kv/kv-v2#read-secret-version): answers
    /// `{"data":{"data":{…},"metadata":{…}}}` for the token `root`, 403 for any other,
    /// 404 for any other path. Returns its address and the request lines it saw.
    async fn fake_vault() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", l.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap();
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let line = req.lines().next().unwrap_or_default().to_string();
                log.lock().unwrap().push(line.clone());
                let authed = req
                    .lines()
                    .any(|l| l.eq_ignore_ascii_case("x-vault-token: root"));
                let (status, body) = if !authed {
                    (
                        "403 Forbidden",
                        r#"{"errors":["permission denied"]}"#.to_string(),
                    )
                } else if line.starts_with("GET /v1/secret/data/team/webdav ") {
                    ("200 OK", r#"{"request_id":"r","lease_id":"","renewable":false,"lease_duration":0,"data":{"data":{"password":"v-pw","n":"1"},"metadata":{"created_time":"2026-01-01T00:00:00Z","deletion_time":"","destroyed":false,"version":3}},"wrap_info":null,"warnings":null,"auth":null}"#.to_string())
                } else {
                    ("404 Not Found", r#"{"errors":[]}"#.to_string())
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        (addr, seen)
    }

    #[tokio::test]
    async fn a_vault_kv2_field_is_read_with_the_nodes_token() {
        let (addr, seen) = fake_vault().await;
        let v = Vault::new(&addr, "root".into()).unwrap();
        let fields = v.read_kv2("secret/team/webdav").await.unwrap().unwrap();
        assert_eq!(fields["password"], "v-pw");
        assert_eq!(
            seen.lock().unwrap()[0],
            "GET /v1/secret/data/team/webdav HTTP/1.1"
        );
        assert_eq!(v.read_kv2("secret/other").await.unwrap(), None);
        let wrong = Vault::new(&addr, "not-root".into()).unwrap();
        let e = wrong.read_kv2("secret/team/webdav").await.unwrap_err();
        assert!(e.contains("403"), "{e}");
        assert!(!e.contains("v-pw"), "{e}");
    }

    #[test]
    fn a_vault_token_never_crosses_the_network_in_clear() {
        assert!(matches!(
            Vault::new("http://vault.example:8200", "t".into()),
            Err(VaultSettingError::Cleartext(_))
        ));
        assert!(Vault::new("https://vault.example:8200", "t".into()).is_ok());
        assert!(Vault::new("http://127.0.0.1:8200", "t".into()).is_ok());
        assert!(format!(
            "{:?}",
            Vault::new("http://127.0.0.1:1", "tok-123".into()).unwrap()
        )
        .find("tok-123")
        .is_none());
    }
}
