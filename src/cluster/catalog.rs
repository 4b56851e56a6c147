//! The volume catalogue: every deferred volume record in the cluster, kept current with a
//! blocking query on the records' variables (Nomad API: `GET /v1/vars?prefix=dhv-binder/volumes/&namespace=*`).

use crate::cluster::trust::{RecordTrust, Refusal, RefusedReason};
use crate::nomad::types::VariableMeta;
use crate::nomad::watch::MIN_QUERY_INTERVAL;
use crate::nomad::Client;
use crate::retry::backoff_delay;
use crate::volume::{VolumeKey, VolumeRecord, RECORD_PREFIX};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// A full snapshot of the catalogue.
pub type Catalogue = BTreeMap<VolumeKey, VolumeRecord>;

/// Told of each refusal as it happens: a record version read and refused, with why (the
/// agent's metrics count them).
pub type RefusalObserver = Arc<dyn Fn(RefusedReason) + Send + Sync>;

/// Records left out of the catalogue, by `<namespace>/<variable path>`, with the reason
/// (malformed, unsigned, forged, an unsigned delete). Shared with the status document.
#[derive(Clone, Default)]
pub struct Rejections {
    current: Arc<Mutex<BTreeMap<String, String>>>,
    observer: Option<RefusalObserver>,
}

impl std::fmt::Debug for Rejections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Rejections").field(&self.snapshot()).finish()
    }
}

impl Rejections {
    /// Rejections that also tell `observer` of every refusal: each version of a record
    /// (its variable's ModifyIndex) once, when a watcher reads and refuses it.
    pub fn observed(observer: RefusalObserver) -> Self {
        Rejections {
            current: Arc::default(),
            observer: Some(observer),
        }
    }

    /// A watcher read a record version and refused it.
    pub(crate) fn refused(&self, reason: RefusedReason) {
        if let Some(o) = &self.observer {
            o(reason);
        }
    }

    /// The current rejections, `<namespace>/<path>` → reason.
    pub fn snapshot(&self) -> BTreeMap<String, String> {
        self.current.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Replaces the rejections of records whose variable path starts with `prefix` (each
    /// watcher owns its prefix: volume records, snapshot records) with `now`.
    pub(crate) fn replace_under(&self, prefix: &str, now: BTreeMap<String, String>) {
        if let Ok(mut m) = self.current.lock() {
            m.retain(|k, _| {
                !k.split_once('/')
                    .is_some_and(|(_, path)| path.starts_with(prefix))
            });
            m.extend(now);
        }
    }
}

/// What a cached variable decoded to: a record to act on, or why it is left out.
type Decoded = Result<VolumeRecord, String>;

/// The pace of a record watch: after each answer the next list waits `floor` plus up to a
/// fifth of it (uniform jitter, so the nodes' lists spread out), unless `nudge` is notified
/// first (an allocation names a volume the node has no record for: list at once). In Nomad
/// a blocking variables list wakes on every variable write in the cluster (the variables
/// table index, `nomad/variables_endpoint.go` `Variables.List`), so without a floor each
/// agent lists once per write anywhere; with it, at most once per floor (docs/scale.md).
#[derive(Debug, Clone)]
pub struct Pace {
    /// The least time between two lists (at least [`MIN_QUERY_INTERVAL`]).
    pub floor: Duration,
    /// Ends the current floor wait early; a notification that arrives while a list is under
    /// way ends the next one (`tokio::sync::Notify` keeps one permit).
    pub nudge: Arc<tokio::sync::Notify>,
}

impl Pace {
    /// A pace of `floor` with its own nudge.
    pub fn new(floor: Duration) -> Self {
        Pace {
            floor,
            nudge: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Waits out the floor from `answered`, or until nudged.
    pub async fn wait_from(&self, answered: tokio::time::Instant) {
        let floor = self.floor.max(MIN_QUERY_INTERVAL);
        let jitter = floor.mul_f64(rand::random::<f64>() / 5.0);
        tokio::select! {
            _ = tokio::time::sleep_until(answered + floor + jitter) => {}
            _ = self.nudge.notified() => {}
        }
    }
}

/// Watches the records and sends a full catalogue after every change, listing at most once
/// per `pace` (see [`Pace`]). Records that do not decode or that `trust` refuses are logged,
/// listed in `rejected` (and told to its observer, once per record version) and left out
/// (never deleted, never acted on).
pub async fn run(
    client: Client,
    wait: Duration,
    pace: Pace,
    trust: RecordTrust,
    rejected: Rejections,
    tx: mpsc::Sender<Catalogue>,
) {
    let mut index = 0u64;
    let mut attempt = 0u32;
    let mut cache: HashMap<(String, String), (u64, Option<Decoded>)> = HashMap::new();
    let mut last_answer: Option<tokio::time::Instant> = None;
    loop {
        if let Some(t) = last_answer.take() {
            pace.wait_from(t).await;
        }
        let list = match client.list_variables(RECORD_PREFIX, "*", index, wait).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list volume records; retrying");
                tokio::time::sleep(backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                    attempt,
                ))
                .await;
                attempt = attempt.saturating_add(1);
                continue;
            }
        };
        attempt = 0;
        last_answer = Some(tokio::time::Instant::now());
        if list.index < index {
            // Index went backwards (restore): start over.
            cache.clear();
        }
        match load(&client, &list.value, &trust, &rejected, &mut cache).await {
            Ok(cat) => {
                rejected.replace_under(RECORD_PREFIX, rejections_of(&cache));
                if tx.send(cat).await.is_err() {
                    return;
                }
                index = list.index.max(1);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read volume records; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The refused entries of a watcher's cache (`(namespace, path)` → (index, decoded)), as
/// `<namespace>/<path>` → reason.
pub(crate) fn rejections_of<'a, T: 'a>(
    cache: impl IntoIterator<Item = (&'a (String, String), &'a (u64, Option<Result<T, String>>))>,
) -> BTreeMap<String, String> {
    cache
        .into_iter()
        .filter_map(|((ns, path), (_, d))| match d {
            Some(Err(reason)) => Some((format!("{ns}/{path}"), reason.clone())),
            _ => None,
        })
        .collect()
}

/// Decodes and checks one variable; `Err` says why it must not be acted on.
pub fn admit(
    var: &crate::nomad::types::Variable,
    trust: &RecordTrust,
) -> Result<VolumeRecord, Refusal> {
    crate::cluster::trust::admit(var, trust, VolumeRecord::from_variable)
}

async fn load(
    client: &Client,
    metas: &[VariableMeta],
    trust: &RecordTrust,
    rejected: &Rejections,
    cache: &mut HashMap<(String, String), (u64, Option<Decoded>)>,
) -> Result<Catalogue, crate::nomad::NomadError> {
    let mut seen = HashMap::new();
    for m in metas {
        let k = (m.namespace.clone(), m.path.clone());
        let cached = cache
            .get(&k)
            .filter(|(idx, _)| *idx == m.modify_index)
            .cloned();
        let entry = match cached {
            Some(c) => c,
            None => {
                let rec = client.variable(&m.namespace, &m.path).await?.map(|var| {
                    admit(&var, trust).map_err(|r| {
                        rejected.refused(r.reason);
                        r.message
                    })
                });
                if let Some(Err(reason)) = &rec {
                    let name = m.path.rsplit('/').next().unwrap_or(&m.path);
                    let volume = crate::escape::escape_control(&format!("{}/{name}", m.namespace));
                    tracing::warn!(
                        %volume,
                        namespace = %crate::escape::escape_control(&m.namespace),
                        path = %crate::escape::escape_control(&m.path),
                        reason = %crate::escape::escape_control(reason),
                        "refusing a volume record: nothing is mounted, created or deleted for it"
                    );
                }
                (m.modify_index, rec)
            }
        };
        seen.insert(k, entry);
    }
    *cache = seen;
    Ok(cache
        .values()
        .filter_map(|(_, r)| r.clone().and_then(Result::ok))
        .map(|r| (r.key(), r))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default floor (`--record-floor 10s`) with its jitter keeps a record change within
    /// 15 s of every node (issue 35): the next list starts between 1 and 1.2 floors after
    /// an answer, and a blocking list answers at once when the index moved meanwhile.
    #[tokio::test(start_paused = true)]
    async fn the_default_floor_lists_again_within_fifteen_seconds() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            agent: crate::config::AgentConfig,
        }
        let cfg = <Cli as clap::Parser>::try_parse_from(["dhv-binder"])
            .expect("defaults parse")
            .agent;
        let pace = Pace::new(cfg.record_floor);
        for _ in 0..50 {
            let t = tokio::time::Instant::now();
            pace.wait_from(t).await;
            let waited = t.elapsed();
            assert!(
                waited >= Duration::from_secs(10) && waited <= Duration::from_secs(12),
                "{waited:?}"
            );
        }
        // A nudge (an allocation names a volume with no record) ends the wait at once.
        let t = tokio::time::Instant::now();
        pace.nudge.notify_one();
        pace.wait_from(t).await;
        assert_eq!(t.elapsed(), Duration::ZERO);
    }

    #[test]
    fn each_watcher_replaces_only_the_rejections_under_its_prefix() {
        let r = Rejections::default();
        let vol = format!("default/{RECORD_PREFIX}data");
        let snap = format!("default/{}x", crate::cluster::snapshot::SNAPSHOT_PREFIX);
        r.replace_under(
            RECORD_PREFIX,
            BTreeMap::from([(vol.clone(), "unsigned".into())]),
        );
        r.replace_under(
            crate::cluster::snapshot::SNAPSHOT_PREFIX,
            BTreeMap::from([(snap.clone(), "forged".into())]),
        );
        assert_eq!(r.snapshot().len(), 2, "{:?}", r.snapshot());
        // The volume watcher's next pass (the record fixed) keeps the snapshot's entry.
        r.replace_under(RECORD_PREFIX, BTreeMap::new());
        assert_eq!(
            r.snapshot(),
            BTreeMap::from([(snap.clone(), "forged".to_string())])
        );
        r.replace_under(crate::cluster::snapshot::SNAPSHOT_PREFIX, BTreeMap::new());
        assert!(r.snapshot().is_empty());
    }
}
