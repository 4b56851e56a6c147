//! Keyring and workload identities: one RSA-2048 root key, RS256 JWTs, the public JWKS.
//!
//! Nomad API: `GET /.well-known/jwks.json` (`command/agent/keyring_endpoint.go`); claims as
//! `nomad/structs/workload_id.go` (default identity: aud "nomadproject.io", no exp).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Validation};
use rsa::pkcs1::EncodeRsaPrivateKey;
use rsa::traits::PublicKeyParts;
use serde_json::{json, Value};

/// Errors creating or using the keyring.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// RSA key generation or encoding failed.
    #[error("rsa: {0}")]
    Rsa(String),
    /// JWT signing/verification failed.
    #[error("jwt: {0}")]
    Jwt(#[from] jsonwebtoken::errors::Error),
}

/// The cluster's root key.
pub struct Keyring {
    /// Key ID (UUID), the JWT header `kid`.
    pub kid: String,
    encoding: EncodingKey,
    decoding: DecodingKey,
    n: String,
    e: String,
    /// The server's `oidc_issuer`: the `iss` claim, and the OIDC discovery document.
    issuer: Option<String>,
}

/// Claims of a default workload identity.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize, PartialEq)]
pub struct WorkloadClaims {
    /// Allocation ID.
    pub nomad_allocation_id: String,
    /// Job ID (parent ID for dispatched/periodic children).
    pub nomad_job_id: String,
    /// Namespace.
    pub nomad_namespace: String,
    /// Task name.
    #[serde(default)]
    pub nomad_task: String,
    /// Subject `<region>:<ns>:<job>:<group>:<task>:<identity>`.
    #[serde(default)]
    pub sub: String,
}

impl Keyring {
    /// Generates a new RSA-2048 root key.
    pub fn generate() -> Result<Self, IdentityError> {
        let mut rng = rand::thread_rng();
        let key = rsa::RsaPrivateKey::new(&mut rng, 2048)
            .map_err(|e| IdentityError::Rsa(e.to_string()))?;
        let der = key
            .to_pkcs1_der()
            .map_err(|e| IdentityError::Rsa(e.to_string()))?;
        let n = URL_SAFE_NO_PAD.encode(key.n().to_bytes_be());
        let e = URL_SAFE_NO_PAD.encode(key.e().to_bytes_be());
        let decoding = DecodingKey::from_rsa_components(&n, &e)?;
        Ok(Keyring {
            kid: uuid::Uuid::new_v4().to_string(),
            encoding: EncodingKey::from_rsa_der(der.as_bytes()),
            decoding,
            n,
            e,
            issuer: None,
        })
    }

    /// Sets the issuer (`server { oidc_issuer }`): `SignClaims` (`nomad/encrypter.go`) adds
    /// it as `iss` to every identity when set, and only then.
    pub fn with_issuer(mut self, issuer: Option<String>) -> Self {
        self.issuer = issuer;
        self
    }

    /// `GET /.well-known/openid-configuration` body, `None` without an issuer (Nomad answers
    /// 404 "OIDC Discovery endpoint disabled": `command/agent/keyring_endpoint.go`
    /// `OIDCDiscoveryRequest`; the document: `nomad/structs/keyring.go`
    /// `NewOIDCDiscoveryConfig`).
    pub fn openid_configuration(&self) -> Option<Value> {
        let iss = self.issuer.as_ref()?;
        Some(json!({
            "issuer": iss,
            "jwks_uri": format!("{}/.well-known/jwks.json", iss.trim_end_matches('/')),
            "id_token_signing_alg_values_supported": ["RS256", "EdDSA"],
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
        }))
    }

    /// `GET /.well-known/jwks.json` body.
    pub fn jwks(&self) -> Value {
        json!({"keys":[{"use":"sig","kty":"RSA","kid":self.kid,"alg":"RS256","n":self.n,"e":self.e}]})
    }

    /// Signs arbitrary claims (keys are emitted in the order given) with header {alg,kid,typ}.
    pub fn sign(&self, claims: &Value) -> Result<String, IdentityError> {
        let header = json!({"alg":"RS256","kid":self.kid,"typ":"JWT"});
        let msg = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &self.encoding, Algorithm::RS256)?;
        Ok(format!("{msg}.{sig}"))
    }

    /// Default identity of a task (claims alphabetically sorted, as go-jose emits them).
    pub fn sign_default_identity(
        &self,
        region: &str,
        namespace: &str,
        job_id: &str,
        group: &str,
        task: &str,
        alloc_id: &str,
    ) -> Result<String, IdentityError> {
        let now = crate::clock::now_secs();
        let mut claims = json!({
            "aud": "nomadproject.io",
            "iat": now,
            "jti": uuid::Uuid::new_v4().to_string(),
            "nbf": now,
            "nomad_allocation_id": alloc_id,
            "nomad_job_id": job_id,
            "nomad_namespace": namespace,
            "nomad_task": task,
            "sub": format!("{region}:{namespace}:{job_id}:{group}:{task}:default"),
        });
        if let (Some(iss), Some(m)) = (&self.issuer, claims.as_object_mut()) {
            m.insert("iss".into(), json!(iss));
        }
        self.sign(&claims)
    }

    /// Verifies a token signed by this keyring (audience "nomadproject.io") and returns its claims.
    pub fn verify(&self, token: &str) -> Result<WorkloadClaims, IdentityError> {
        let mut v = Validation::new(Algorithm::RS256);
        v.set_audience(&["nomadproject.io"]);
        v.required_spec_claims.clear();
        v.validate_exp = false;
        let data = jsonwebtoken::decode::<WorkloadClaims>(token, &self.decoding, &v)?;
        Ok(data.claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(token: &str) -> Value {
        let p = token.split('.').nth(1).unwrap();
        serde_json::from_slice(&URL_SAFE_NO_PAD.decode(p).unwrap()).unwrap()
    }

    /// `SignClaims` (`nomad/encrypter.go`): `iss` only when the server has an issuer.
    #[test]
    fn identities_carry_iss_only_with_an_oidc_issuer() {
        let k = Keyring::generate().unwrap();
        let t = k
            .sign_default_identity("global", "default", "j", "g", "t", "a")
            .unwrap();
        assert!(payload(&t).get("iss").is_none());
        assert!(k.openid_configuration().is_none());
        let k = k.with_issuer(Some("https://nomad.example".into()));
        let t = k
            .sign_default_identity("global", "default", "j", "g", "t", "a")
            .unwrap();
        assert_eq!(payload(&t)["iss"], "https://nomad.example");
    }
}
