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
    issuer: IssuerRule,
    cache: RwLock<Cached>,
    fetching: Mutex<()>,
    ttl: Duration,
    refetch_min: Duration,
}

#[derive(Default)]
struct Cached {
    set: Option<JwkSet>,
    fetched: Option<Instant>,
    /// The cluster's issuer as fetched with the keys ([`IssuerRule::Cluster`]): `Some(None)`
    /// when the cluster has none.
    issuer: Option<Option<String>>,
}

/// Which `iss` a workload identity token must carry (`--token-issuer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IssuerRule {
    /// The cluster's own (the default): learnt with the keys from
    /// `GET /.well-known/openid-configuration`; a cluster without an `oidc_issuer` answers
    /// 404 there, and then a token must carry no `iss` at all.
    Cluster,
    /// Exactly this issuer (an operator's override).
    Pinned(String),
    /// Not checked (`--token-issuer any`).
    Any,
}

impl IssuerRule {
    /// The rule of a `--token-issuer` setting: unset, empty or `cluster` → [`Cluster`],
    /// `any` → [`Any`], anything else → [`Pinned`].
    ///
    /// [`Cluster`]: IssuerRule::Cluster
    /// [`Any`]: IssuerRule::Any
    /// [`Pinned`]: IssuerRule::Pinned
    pub fn from_setting(setting: Option<&str>) -> Self {
        match setting.map(str::trim) {
            None | Some("") | Some("cluster") => IssuerRule::Cluster,
            Some("any") => IssuerRule::Any,
            Some(iss) => IssuerRule::Pinned(iss.to_string()),
        }
    }
}

/// What [`verify_with`] checks of `iss`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IssuerCheck<'a> {
    /// Anything, or nothing.
    Any,
    /// Required, and equal to this.
    Equals(&'a str),
    /// Must be absent (the cluster sets no issuer, so none of its tokens has one).
    Absent,
}

/// Shortest time between two refetches for unknown `kid`s.
pub const REFETCH_MIN: Duration = Duration::from_secs(10);
/// How long a fetched JWKS is trusted before it is fetched again.
pub const JWKS_TTL: Duration = Duration::from_secs(300);
/// How far in the future a token's `iat` may be (clock skew between servers and this node).
pub const IAT_SKEW: u64 = 60;

impl Verifier {
    /// A verifier accepting `nomadproject.io` and `extra_audiences`, with the cluster's
    /// issuer ([`IssuerRule::Cluster`]).
    pub fn new(client: Client, extra_audiences: &[String]) -> Self {
        let mut audiences = vec!["nomadproject.io".to_string()];
        audiences.extend(extra_audiences.iter().cloned());
        Self {
            client,
            audiences,
            issuer: IssuerRule::Cluster,
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

    /// Sets which `iss` tokens must carry ([`IssuerRule`]).
    pub fn with_issuer(mut self, issuer: IssuerRule) -> Self {
        self.issuer = issuer;
        self
    }

    /// The keys that may have signed `kid`'s tokens, and the cluster's issuer (`None` unless
    /// the rule is [`IssuerRule::Cluster`]; `Some(None)`: the cluster has none).
    async fn key_set(&self, kid: &str) -> Result<(JwkSet, Option<Option<String>>), IdentityError> {
        let asked = Instant::now();
        let usable = |c: &Cached| -> Option<(JwkSet, Option<Option<String>>)> {
            let (set, at) = (c.set.as_ref()?, c.fetched?);
            let age = at.elapsed();
            (age < self.ttl && (set.find(kid).is_some() || age < self.refetch_min))
                .then(|| (set.clone(), c.issuer.clone()))
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
                    return Ok((set.clone(), c.issuer.clone()));
                }
            }
            if let Some(found) = usable(&c) {
                return Ok(found);
            }
        }
        let set = self.client.jwks().await?;
        // The issuer is fetched with the keys and trusted as long.
        let issuer = match self.issuer {
            IssuerRule::Cluster => Some(self.client.oidc_issuer().await?),
            _ => None,
        };
        *self.cache.write().await = Cached {
            set: Some(set.clone()),
            fetched: Some(Instant::now()),
            issuer: issuer.clone(),
        };
        Ok((set, issuer))
    }

    /// Verifies `token` and returns its claims.
    pub async fn verify(&self, token: &str) -> Result<Claims, IdentityError> {
        let header = decode_header(token).map_err(|e| IdentityError::Malformed(e.to_string()))?;
        let kid = header
            .kid
            .ok_or_else(|| IdentityError::Malformed("no kid in the header".into()))?;
        let (set, cluster_issuer) = self.key_set(&kid).await?;
        let jwk = set
            .find(&kid)
            .ok_or_else(|| IdentityError::UnknownKey(crate::escape::escape_control(&kid)))?;
        let key = DecodingKey::from_jwk(jwk).map_err(|e| IdentityError::Invalid(e.to_string()))?;
        let check = match (&self.issuer, &cluster_issuer) {
            (IssuerRule::Any, _) => IssuerCheck::Any,
            (IssuerRule::Pinned(iss), _) => IssuerCheck::Equals(iss),
            (IssuerRule::Cluster, Some(Some(iss))) => IssuerCheck::Equals(iss),
            (IssuerRule::Cluster, _) => IssuerCheck::Absent,
        };
        verify_with(token, &key, header.alg, &self.audiences, check)
    }
}

#[derive(Deserialize)]
struct Times {
    #[serde(default)]
    iat: Option<u64>,
    #[serde(default)]
    iss: Option<serde_json::Value>,
}

/// Verifies a token with a known key: algorithm RS256 or EdDSA, a required `aud` among
/// `audiences`, `iss` as `issuer` says ([`IssuerCheck`]), `nbf`, `exp` only when present,
/// and `iat` not more than [`IAT_SKEW`] seconds in the future.
pub fn verify_with(
    token: &str,
    key: &DecodingKey,
    alg: Algorithm,
    audiences: &[String],
    issuer: IssuerCheck<'_>,
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
    if let IssuerCheck::Equals(iss) = issuer {
        v.set_issuer(&[iss]);
        v.required_spec_claims.insert("iss".into());
    }
    let data = decode::<serde_json::Value>(token, key, &v)
        .map_err(|e| IdentityError::Invalid(e.to_string()))?;
    let times: Times = serde_json::from_value(data.claims.clone())
        .map_err(|e| IdentityError::Invalid(format!("iat: {e}")))?;
    if issuer == IssuerCheck::Absent && times.iss.is_some() {
        return Err(IdentityError::Invalid(
            "the token has an issuer (iss) but this cluster sets none (its OIDC discovery endpoint answers 404): it was not issued by this cluster; if it was, set --token-issuer to the servers' oidc_issuer".into(),
        ));
    }
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
            IssuerCheck::Any,
        )
        .unwrap();
        assert_eq!(
            c.nomad_allocation_id,
            "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70"
        );
        assert_eq!(c.nomad_task, "dhv-wait");
        // Wrong audience is refused.
        assert!(verify_with(
            token,
            &key,
            Algorithm::RS256,
            &["other".into()],
            IssuerCheck::Any
        )
        .is_err());
        // A tampered payload is refused.
        let mut parts: Vec<&str> = token.split('.').collect();
        let forged = "eyJub21hZF9hbGxvY2F0aW9uX2lkIjoieCIsIm5vbWFkX25hbWVzcGFjZSI6ImRlZmF1bHQiLCJhdWQiOiJub21hZHByb2plY3QuaW8ifQ";
        parts[1] = forged;
        assert!(verify_with(
            &parts.join("."),
            &key,
            Algorithm::RS256,
            &["nomadproject.io".into()],
            IssuerCheck::Any,
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
        assert!(verify_with(&ok, &dec, Algorithm::EdDSA, &aud, IssuerCheck::Any).is_ok());
        assert!(verify_with(
            &ok,
            &dec,
            Algorithm::EdDSA,
            &aud,
            IssuerCheck::Equals("https://nomad.example")
        )
        .is_ok());
        let e = verify_with(
            &ok,
            &dec,
            Algorithm::EdDSA,
            &aud,
            IssuerCheck::Equals("https://other"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        // No aud at all: refused (jsonwebtoken would otherwise skip the audience check).
        let no_aud = token(&enc, "k1", claims(serde_json::json!({"iat": now})));
        assert!(verify_with(&no_aud, &dec, Algorithm::EdDSA, &aud, IssuerCheck::Any).is_err());
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
            IssuerCheck::Equals("https://nomad.example")
        )
        .is_err());
        assert!(verify_with(&no_iss, &dec, Algorithm::EdDSA, &aud, IssuerCheck::Any).is_ok());
        // Issued an hour from now: refused; within the skew: accepted.
        let future = token(
            &enc,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io", "iat": now + 3600})),
        );
        let e = verify_with(&future, &dec, Algorithm::EdDSA, &aud, IssuerCheck::Any).unwrap_err();
        assert!(e.to_string().contains("in the future"), "{e}");
        let skewed = token(
            &enc,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io", "iat": now + 10})),
        );
        assert!(verify_with(&skewed, &dec, Algorithm::EdDSA, &aud, IssuerCheck::Any).is_ok());
    }

    /// A loopback JWKS server that counts its JWKS requests and serves whatever `keys` holds;
    /// its OIDC discovery document names `issuer`, or answers 404 without one (as Nomad).
    async fn jwks_server(
        keys: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    ) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        discovery_server(keys, None).await
    }

    async fn discovery_server(
        keys: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
        issuer: Option<&'static str>,
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
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if String::from_utf8_lossy(&buf[..n]).contains("openid-configuration") {
                        let resp = match issuer {
                            Some(iss) => {
                                let body = serde_json::json!({"issuer": iss}).to_string();
                                format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
                            }
                            None => "HTTP/1.1 404 Not Found\r\nContent-Length: 32\r\nConnection: close\r\n\r\nOIDC Discovery endpoint disabled".to_string(),
                        };
                        let _ = s.write_all(resp.as_bytes()).await;
                        return;
                    }
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

    /// Issue 33 finding 7: by default the issuer is the cluster's. A cluster without an
    /// `oidc_issuer` (discovery 404) signs tokens without `iss`, so one with an `iss` is
    /// refused; a cluster with one requires exactly it; `--token-issuer` overrides.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_clusters_issuer_is_checked_by_default() {
        let (jwk, enc, _) = ed_key("k1");
        let keys = std::sync::Arc::new(std::sync::Mutex::new(vec![jwk]));
        let plain = token(
            &enc,
            "k1",
            claims(serde_json::json!({"aud": "nomadproject.io"})),
        );
        let with_iss = |iss: &str| {
            token(
                &enc,
                "k1",
                claims(serde_json::json!({"aud": "nomadproject.io", "iss": iss})),
            )
        };
        // No oidc_issuer in the cluster: no iss allowed.
        let (addr, _) = discovery_server(keys.clone(), None).await;
        let v = Verifier::new(client(&addr), &[]);
        assert!(v.verify(&plain).await.is_ok());
        let e = v.verify(&with_iss("https://elsewhere")).await.unwrap_err();
        assert!(e.to_string().contains("sets none"), "{e}");
        // With one: exactly it, and required.
        let (addr, _) = discovery_server(keys.clone(), Some("https://nomad.example:4646")).await;
        let v = Verifier::new(client(&addr), &[]);
        assert!(v
            .verify(&with_iss("https://nomad.example:4646"))
            .await
            .is_ok());
        assert!(v.verify(&with_iss("https://elsewhere")).await.is_err());
        assert!(v.verify(&plain).await.is_err(), "iss is required");
        // The override: pinned, or not checked.
        let v = Verifier::new(client(&addr), &[])
            .with_issuer(IssuerRule::from_setting(Some("https://elsewhere")));
        assert!(v.verify(&with_iss("https://elsewhere")).await.is_ok());
        assert!(v
            .verify(&with_iss("https://nomad.example:4646"))
            .await
            .is_err());
        let v =
            Verifier::new(client(&addr), &[]).with_issuer(IssuerRule::from_setting(Some("any")));
        assert!(v.verify(&plain).await.is_ok());
        assert_eq!(IssuerRule::from_setting(None), IssuerRule::Cluster);
        assert_eq!(
            IssuerRule::from_setting(Some("cluster")),
            IssuerRule::Cluster
        );
    }
}
