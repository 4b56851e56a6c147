//! Verifies Nomad workload identity tokens offline, against the cluster's JWKS.
//!
//! Nomad signs task identities with RS256 (EdDSA for old root keys), header `kid` = the
//! root key ID; the default identity has `aud = "nomadproject.io"` and **no `exp`**
//! (nomad-facts.md §5). Because default tokens never expire, the caller must also check
//! that the allocation exists and is not terminal, as Nomad's own auth does.

use crate::nomad::{Client, NomadError};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{decode, decode_header, Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use tokio::sync::RwLock;

/// The claims dhv-binder uses.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Claims {
    pub nomad_allocation_id: String,
    pub nomad_namespace: String,
    #[serde(default)]
    pub nomad_job_id: String,
    #[serde(default)]
    pub nomad_task: String,
}

/// Why a token was refused. The token itself is never part of the message.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("the token is not a Nomad workload identity ({0}): the prestart task must send its own NOMAD_TOKEN (set identity {{ env = true }} on it)")]
    Malformed(String),
    #[error("the workload identity token is signed with key {0:?}, which the cluster's JWKS does not list")]
    UnknownKey(String),
    #[error("the workload identity token was refused: {0}")]
    Invalid(String),
    #[error("cannot fetch the cluster's JWKS to check the token: {0}")]
    Jwks(#[from] NomadError),
}

/// A JWKS cache that refetches on an unknown `kid` (at most every 10 s).
pub struct Verifier {
    client: Client,
    audiences: Vec<String>,
    cache: RwLock<(Option<JwkSet>, Option<Instant>)>,
}

const REFETCH_MIN: Duration = Duration::from_secs(10);

impl Verifier {
    /// A verifier accepting `nomadproject.io` and `extra_audiences`.
    pub fn new(client: Client, extra_audiences: &[String]) -> Self {
        let mut audiences = vec!["nomadproject.io".to_string()];
        audiences.extend(extra_audiences.iter().cloned());
        Self {
            client,
            audiences,
            cache: RwLock::new((None, None)),
        }
    }

    async fn key_set(&self, kid: &str) -> Result<JwkSet, IdentityError> {
        {
            let c = self.cache.read().await;
            if let Some(set) = &c.0 {
                let fresh = c.1.is_some_and(|t| t.elapsed() < REFETCH_MIN);
                if set.find(kid).is_some() || fresh {
                    return Ok(set.clone());
                }
            }
        }
        let set = self.client.jwks().await?;
        let mut c = self.cache.write().await;
        *c = (Some(set.clone()), Some(Instant::now()));
        Ok(set)
    }

    /// Verifies `token` and returns its claims.
    pub async fn verify(&self, token: &str) -> Result<Claims, IdentityError> {
        let header = decode_header(token).map_err(|e| IdentityError::Malformed(e.to_string()))?;
        let kid = header
            .kid
            .ok_or_else(|| IdentityError::Malformed("no kid in the header".into()))?;
        let set = self.key_set(&kid).await?;
        let jwk = set
            .find(&kid)
            .ok_or_else(|| IdentityError::UnknownKey(kid.clone()))?;
        let key = DecodingKey::from_jwk(jwk).map_err(|e| IdentityError::Invalid(e.to_string()))?;
        verify_with(token, &key, header.alg, &self.audiences)
    }
}

/// Verifies a token with a known key: algorithm RS256 or EdDSA, audience, `nbf`, and `exp`
/// only when present.
pub fn verify_with(
    token: &str,
    key: &DecodingKey,
    alg: Algorithm,
    audiences: &[String],
) -> Result<Claims, IdentityError> {
    if !matches!(alg, Algorithm::RS256 | Algorithm::EdDSA) {
        return Err(IdentityError::Invalid(format!(
            "algorithm {alg:?} is not one Nomad signs with"
        )));
    }
    let mut v = Validation::new(alg);
    v.required_spec_claims = HashSet::new();
    v.validate_nbf = true;
    v.leeway = 30;
    v.set_audience(audiences);
    decode::<Claims>(token, key, &v)
        .map(|d| d.claims)
        .map_err(|e| IdentityError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The synthesised fixture tokens are RS256-signed by the key in jwks.json.
    #[test]
    fn verifies_fixture_tokens() {
        let base = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/nomad-fixtures");
        let jwks: JwkSet = serde_json::from_str(
            &std::fs::read_to_string(format!("{base}/jwks.json"))
                .expect("testdata/nomad-fixtures/jwks.json"),
        )
        .unwrap();
        let wi: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{base}/workload-identity.json")).unwrap(),
        )
        .unwrap();
        let token = wi["default_identity"]["compact"].as_str().unwrap();
        let kid = decode_header(token).unwrap().kid.unwrap();
        let key = DecodingKey::from_jwk(jwks.find(&kid).unwrap()).unwrap();
        let c = verify_with(token, &key, Algorithm::RS256, &["nomadproject.io".into()]).unwrap();
        assert_eq!(
            c.nomad_allocation_id,
            "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70"
        );
        assert_eq!(c.nomad_task, "dhv-wait");
        // Wrong audience is refused.
        assert!(verify_with(token, &key, Algorithm::RS256, &["other".into()]).is_err());
        // A tampered payload is refused.
        let mut parts: Vec<&str> = token.split('.').collect();
        let forged = "eyJub21hZF9hbGxvY2F0aW9uX2lkIjoieCIsIm5vbWFkX25hbWVzcGFjZSI6ImRlZmF1bHQiLCJhdWQiOiJub21hZHByb2plY3QuaW8ifQ";
        parts[1] = forged;
        assert!(verify_with(
            &parts.join("."),
            &key,
            Algorithm::RS256,
            &["nomadproject.io".into()]
        )
        .is_err());
    }
}
