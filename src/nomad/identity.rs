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
use tokio::sync::{Mutex, RwLock};

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

/// A JWKS cache: keys are trusted for [`JWKS_TTL`] after they were fetched (a key the cluster
/// removed stops being trusted within it); an unknown `kid` triggers one shared refetch (all
/// callers waiting at that moment use its answer), at most every [`REFETCH_MIN`].
pub struct Verifier {
    client: Client,
    audiences: Vec<String>,
    issuer: Option<String>,
    cache: RwLock<Cached>,
    fetching: Mutex<()>,
    ttl: Duration,
    refetch_min: Duration,
}

#[derive(Default)]
struct Cached {
    set: Option<JwkSet>,
    fetched: Option<Instant>,
}

/// Shortest time between two refetches for unknown `kid`s.
pub const REFETCH_MIN: Duration = Duration::from_secs(10);
/// How long a fetched JWKS is trusted before it is fetched again.
pub const JWKS_TTL: Duration = Duration::from_secs(300);
/// How far in the future a token's `iat` may be (clock skew between servers and this node).
pub const IAT_SKEW: u64 = 60;

impl Verifier {
    /// A verifier accepting `nomadproject.io` and `extra_audiences`, any issuer.
    pub fn new(client: Client, extra_audiences: &[String]) -> Self {
        let mut audiences = vec!["nomadproject.io".to_string()];
        audiences.extend(extra_audiences.iter().cloned());
        Self {
            client,
            audiences,
            issuer: None,
            cache: RwLock::new(Cached::default()),
            fetching: Mutex::new(()),
            ttl: JWKS_TTL,
            refetch_min: REFETCH_MIN,
        }
    }

    /// Sets the cache's TTL and the shortest time between refetches for unknown `kid`s.
    pub fn with_cache_times(mut self, ttl: Duration, refetch_min: Duration) -> Self {
        self.ttl = ttl;
        self.refetch_min = refetch_min;
        self
    }

    /// Also requires `iss` to equal `issuer` (the cluster's `oidc_issuer`, when it sets one).
    pub fn with_issuer(mut self, issuer: Option<String>) -> Self {
        self.issuer = issuer.filter(|i| !i.is_empty());
        self
    }

    async fn key_set(&self, kid: &str) -> Result<JwkSet, IdentityError> {
        let asked = Instant::now();
        let usable = |c: &Cached| -> Option<JwkSet> {
            let (set, at) = (c.set.as_ref()?, c.fetched?);
            let age = at.elapsed();
            (age < self.ttl && (set.find(kid).is_some() || age < self.refetch_min))
                .then(|| set.clone())
        };
        if let Some(set) = usable(&*self.cache.read().await) {
            return Ok(set);
        }
        // One fetch at a time; whoever waited behind a fetch uses its answer.
        let _one = self.fetching.lock().await;
        {
            let c = self.cache.read().await;
            if let (Some(set), Some(at)) = (&c.set, c.fetched) {
                if at >= asked {
                    return Ok(set.clone());
                }
            }
            if let Some(set) = usable(&c) {
                return Ok(set);
            }
        }
        let set = self.client.jwks().await?;
        *self.cache.write().await = Cached {
            set: Some(set.clone()),
            fetched: Some(Instant::now()),
        };
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
            .ok_or_else(|| IdentityError::UnknownKey(crate::escape::escape_control(&kid)))?;
        let key = DecodingKey::from_jwk(jwk).map_err(|e| IdentityError::Invalid(e.to_string()))?;
        verify_with(
            token,
            &key,
            header.alg,
            &self.audiences,
            self.issuer.as_deref(),
        )
    }
}

#[derive(Deserialize)]
struct Times {
    #[serde(default)]
    iat: Option<u64>,
}

/// Verifies a token with a known key: algorithm RS256 or EdDSA, a required `aud` among
/// `audiences`, `iss` when `issuer` is given, `nbf`, `exp` only when present, and `iat` not
/// more than [`IAT_SKEW`] seconds in the future.
pub fn verify_with(
    token: &str,
    key: &DecodingKey,
    alg: Algorithm,
    audiences: &[String],
    issuer: Option<&str>,
) -> Result<Claims, IdentityError> {
    if !matches!(alg, Algorithm::RS256 | Algorithm::EdDSA) {
        return Err(IdentityError::Invalid(format!(
            "algorithm {alg:?} is not one Nomad signs with"
        )));
    }
    let mut v = Validation::new(alg);
    v.required_spec_claims = HashSet::from(["aud".to_string()]);
    v.validate_nbf = true;
    v.leeway = 30;
    v.set_audience(audiences);
    if let Some(iss) = issuer {
        v.set_issuer(&[iss]);
        v.required_spec_claims.insert("iss".into());
    }
    let data = decode::<serde_json::Value>(token, key, &v)
        .map_err(|e| IdentityError::Invalid(e.to_string()))?;
    let times: Times = serde_json::from_value(data.claims.clone())
        .map_err(|e| IdentityError::Invalid(format!("iat: {e}")))?;
    let now = jsonwebtoken::get_current_timestamp();
    if times
        .iat
        .is_some_and(|iat| iat > now.saturating_add(IAT_SKEW))
    {
        return Err(IdentityError::Invalid(
            "the token was issued in the future (iat): check the clocks of the Nomad servers and this node".into(),
        ));
    }
    serde_json::from_value(data.claims).map_err(|e| IdentityError::Invalid(e.to_string()))
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
        let c = verify_with(
            token,
            &key,
            Algorithm::RS256,
            &["nomadproject.io".into()],
            None,
        )
        .unwrap();
        assert_eq!(
            c.nomad_allocation_id,
            "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70"
        );
        assert_eq!(c.nomad_task, "dhv-wait");
        // Wrong audience is refused.
        assert!(verify_with(token, &key, Algorithm::RS256, &["other".into()], None).is_err());
        // A tampered payload is refused.
        let mut parts: Vec<&str> = token.split('.').collect();
        let forged = "eyJub21hZF9hbGxvY2F0aW9uX2lkIjoieCIsIm5vbWFkX25hbWVzcGFjZSI6ImRlZmF1bHQiLCJhdWQiOiJub21hZHByb2plY3QuaW8ifQ";
        parts[1] = forged;
        assert!(verify_with(
            &parts.join("."),
            &key,
            Algorithm::RS256,
            &["nomadproject.io".into()],
            None
        )
        .is_err());
    }

    use jsonwebtoken::{encode, EncodingKey, Header};
    use ring::signature::{Ed25519KeyPair, KeyPair};

    /// An Ed25519 key as Nomad's JWKS would list it, and its signing key.
    fn ed_key(kid: &str) -> (serde_json::Value, EncodingKey, DecodingKey) {
        use base64::Engine as _;
        let doc = Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new()).unwrap();
        let pair = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
        let x = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(pair.public_key().as_ref());
        let jwk = serde_json::json!({"kty":"OKP","crv":"Ed25519","x":x,"kid":kid,"alg":"EdDSA","use":"sig"});
        (
            jwk,
            EncodingKey::from_ed_der(doc.as_ref()),
            DecodingKey::from_ed_der(pair.public_key().as_ref()),
        )
    }

    fn token(enc: &EncodingKey, kid: &str, claims: serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::EdDSA);
        h.kid = Some(kid.into());
        encode(&h, &claims, enc).unwrap()
    }

    fn claims(extra: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({
            "nomad_allocation_id": "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70",
            "nomad_namespace": "default",
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    #[test]
    fn aud_is_required_iss_pinned_and_iat_bounded() {
        let (_, enc, dec) = ed_key("k1");
        let aud = ["nomadproject.io".to_string()];
        let now = jsonwebtoken::get_current_timestamp();
        let ok = token(
            &enc,
            "k1",
            claims(
                serde_json::json!({"aud": "nomadproject.io", "iat": now, "iss": "https://nomad.example"}),
            ),
        );
        assert!(verify_with(&ok, &dec, Algorithm::EdDSA, &aud, None).is_ok());
        assert!(verify_with(
            &ok,
            &dec,
            Algorithm::EdDSA,
            &aud,
            Some("https://nomad.example")
        )
        .is_ok());
        let e = verify_with(&ok, &dec, Algorithm::EdDSA, &aud, Some("https://other")).unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        // No aud at all: refused (jsonwebtoken would otherwise skip the audience check).
        let no_aud = token(&enc, "k1", claims(serde_json::json!({"iat": now})));
        assert!(verify_with(&no_aud, &dec, Algorithm::EdDSA, &aud, None).is_err());
        // No iss while one is pinned: refused.
        let no_iss = token(
            &enc,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io"})),
        );
        assert!(verify_with(
            &no_iss,
            &dec,
            Algorithm::EdDSA,
            &aud,
            Some("https://nomad.example")
        )
        .is_err());
        assert!(verify_with(&no_iss, &dec, Algorithm::EdDSA, &aud, None).is_ok());
        // Issued an hour from now: refused; within the skew: accepted.
        let future = token(
            &enc,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io", "iat": now + 3600})),
        );
        let e = verify_with(&future, &dec, Algorithm::EdDSA, &aud, None).unwrap_err();
        assert!(e.to_string().contains("in the future"), "{e}");
        let skewed = token(
            &enc,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io", "iat": now + 10})),
        );
        assert!(verify_with(&skewed, &dec, Algorithm::EdDSA, &aud, None).is_ok());
    }

    /// A loopback JWKS server that counts its requests and serves whatever `keys` holds.
    async fn jwks_server(
        keys: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    ) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", l.local_addr().unwrap());
        let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let keys = keys.clone();
                let h = h.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    // Slow enough that concurrent callers pile up behind one fetch.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let body = serde_json::json!({"keys": *keys.lock().unwrap()}).to_string();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                });
            }
        });
        (addr, hits)
    }

    fn client(addr: &str) -> Client {
        Client::new(&crate::config::NomadConfig::plain(addr)).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unknown_kids_share_one_fetch_and_removed_keys_expire() {
        let (jwk1, enc1, _) = ed_key("k1");
        let keys = std::sync::Arc::new(std::sync::Mutex::new(vec![jwk1]));
        let (addr, hits) = jwks_server(keys.clone()).await;
        let v = std::sync::Arc::new(
            Verifier::new(client(&addr), &[])
                .with_cache_times(Duration::from_millis(1500), Duration::from_secs(60)),
        );
        let good = token(
            &enc1,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io"})),
        );
        let (_, enc9, _) = ed_key("k9");
        let unknown = token(
            &enc9,
            "k9",
            claims(serde_json::json!({"aud": "nomadproject.io"})),
        );
        let mut calls = Vec::new();
        for i in 0..200 {
            let v = v.clone();
            let t = if i % 2 == 0 {
                good.clone()
            } else {
                unknown.clone()
            };
            calls.push(tokio::spawn(async move { v.verify(&t).await.is_ok() }));
        }
        let mut ok = 0;
        for c in calls {
            ok += usize::from(c.await.unwrap());
        }
        assert_eq!(ok, 100, "the known key verifies, the unknown one does not");
        let fetches = hits.load(std::sync::atomic::Ordering::SeqCst);
        eprintln!("200 concurrent calls (100 with an unknown kid) made {fetches} JWKS fetch(es)");
        assert_eq!(fetches, 1);
        // The cluster drops k1: once the TTL passed, tokens signed with it are refused.
        keys.lock().unwrap().clear();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match v.verify(&good).await {
                Err(IdentityError::UnknownKey(_)) => break,
                Ok(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                other => panic!("a removed key stayed trusted: {other:?}"),
            }
        }
        assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
