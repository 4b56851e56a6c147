//! The volume catalogue: every deferred volume record in the cluster, kept current by
//! following the change marker ([`crate::cluster::changes`]): one list at start (Nomad API:
//! `GET /v1/vars?prefix=dhv-binder/volumes/&namespace=*`), then only the records the marker
//! names (`GET /v1/var/:path`), and a full list again after a gap and every `--record-relist`.

use crate::cluster::changes::{MarkerView, Seen, Since};
use crate::cluster::trust::{RecordTrust, Refusal, RefusedReason};
use crate::nomad::retry::backoff_delay;
use crate::nomad::types::Variable;
use crate::nomad::{Client, NomadError};
use crate::volume::{VolumeKey, VolumeRecord, RECORD_PREFIX};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// A full snapshot of the catalogue. Each record is shared (`Arc`) between the watch's
/// cache, the snapshots it sends and the agent's loop: a snapshot copies the map, never the
/// records (docs/scale.md, memory per record).
pub type Catalogue = BTreeMap<VolumeKey, Arc<VolumeRecord>>;

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

/// A record watch's cache: `(namespace, path)` → (ModifyIndex, what the variable decoded to;
/// `None`: it was gone when read).
pub(crate) type Cache<T> = BTreeMap<(String, String), (u64, Option<Result<T, String>>)>;

/// How often a record watch lists every record while the change marker cannot be read (a
/// token whose policy lacks it), plus up to a fifth of it (jitter); with the marker, the
/// watch lists every `--record-relist` (default 5 min) instead.
pub const FALLBACK_RELIST: Duration = Duration::from_secs(10);

/// Records to read at once, by `(namespace, variable path)`: an allocation names a volume the
/// node has no record for (the agent's loop asks, [`Reads::ask`]); the watch reads each with
/// one `GET /v1/var/:path`, whatever the marker says, so a prestart never waits for it.
#[derive(Debug, Clone, Default)]
pub struct Reads {
    want: Arc<Mutex<BTreeSet<(String, String)>>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Reads {
    /// Asks the watch to read the record at `path` in `namespace` now.
    pub fn ask(&self, namespace: &str, path: &str) {
        if let Ok(mut w) = self.want.lock() {
            w.insert((namespace.to_string(), path.to_string()));
        }
        self.notify.notify_one();
    }

    fn take(&self) -> BTreeSet<(String, String)> {
        self.want
            .lock()
            .map(|mut w| std::mem::take(&mut *w))
            .unwrap_or_default()
    }
}

/// How a record watch follows the records: the change marker's latest state (from
/// [`crate::cluster::changes::watch`]), the safety relist, and the records to read at once.
#[derive(Debug, Clone)]
pub struct Follow {
    /// The marker, as the agent's one marker watch last read it.
    pub marker: tokio::sync::watch::Receiver<MarkerView>,
    /// Every record is listed again after this long without a full list (plus up to a fifth
    /// of it), in case a writer did not update the marker.
    pub relist: Duration,
    /// Records to read at once.
    pub reads: Reads,
    /// Told why the records cannot be read (the error of the last list or read, e.g.
    /// Nomad's 403), and `None` once they are read again: what the agent says of the
    /// volumes it keeps meanwhile. `None`: not told.
    pub failing: Option<tokio::sync::watch::Sender<Option<String>>>,
}

/// One kind of record a watch follows: its variable prefix, how a variable decodes and is
/// checked, and the warning for one refused.
pub(crate) struct Kind<T> {
    pub prefix: &'static str,
    pub admit: fn(&Variable, &RecordTrust) -> Result<T, Refusal>,
    pub refused: fn(namespace: &str, path: &str, reason: &str),
}

/// Follows the records under `kind.prefix` and sends `out(cache)` on `tx` after every change:
/// one list (`GET /v1/vars?prefix=...&namespace=*`, not blocking) at start, after a gap in the
/// marker's ring, after an error and every `relist`; in between, only the records the marker
/// names (`GET /v1/var/:path`, skipped when the cache already holds that ModifyIndex) and
/// those asked for through [`Reads`]. Records that do not decode or that `trust` refuses are
/// logged, listed in `rejected` and left out (never deleted, never acted on). Returns when
/// `tx` or the marker watch is gone.
pub(crate) async fn follow<T: Clone, Out>(
    client: Client,
    kind: Kind<T>,
    mut f: Follow,
    trust: RecordTrust,
    rejected: Rejections,
    out: fn(&Cache<T>) -> Out,
    tx: mpsc::Sender<Out>,
) {
    let mut cache: Cache<T> = BTreeMap::new();
    let mut seen: Option<Seen> = None;
    let mut full = true;
    let mut attempt = 0u32;
    let mut failures = crate::nomad::retry::FailureLog::new(
        crate::nomad::retry::Call::RecordWatch,
        crate::nomad::retry::LOG_EVERY,
    );
    let mut relist_at = tokio::time::Instant::now();
    let jittered = |d: Duration| d + d.mul_f64(rand::random::<f64>() / 5.0);
    // The first list is the base the marker's changes are counted from: wait (briefly) for
    // the marker's first answer so that one list is enough.
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        f.marker.wait_for(|m| *m != MarkerView::Unknown),
    )
    .await;
    loop {
        let step: Result<bool, NomadError> = if full {
            let base = f.marker.borrow_and_update().clone();
            match list_all(&client, &kind, &trust, &rejected, &mut cache).await {
                Ok(()) => {
                    full = false;
                    let (s, every) = match &base {
                        MarkerView::Seen(m) => (Some(m.seen()), f.relist),
                        MarkerView::Unavailable => (None, FALLBACK_RELIST),
                        MarkerView::Unknown => (None, f.relist),
                    };
                    seen = s;
                    relist_at = tokio::time::Instant::now() + jittered(every);
                    Ok(true)
                }
                Err(e) => Err(e),
            }
        } else {
            tokio::select! {
                r = f.marker.changed() => {
                    if r.is_err() {
                        return;
                    }
                    let view = f.marker.borrow_and_update().clone();
                    match view {
                        MarkerView::Seen(m) => match m.since(seen) {
                            Since::Nothing => Ok(false),
                            Since::Gap => {
                                full = true;
                                continue;
                            }
                            Since::Changes(changes) => {
                                let mine = changes
                                    .into_iter()
                                    .filter(|c| c.path.starts_with(kind.prefix))
                                    .map(|c| ((c.namespace, c.path), c.index));
                                // The relist comes at its time, whatever reads are in flight.
                                let r = tokio::time::timeout_at(
                                    relist_at,
                                    read_some(&client, &kind, &trust, &rejected, &mut cache, mine),
                                )
                                .await;
                                match r {
                                    Ok(Ok(changed)) => {
                                        seen = Some(m.seen());
                                        Ok(changed)
                                    }
                                    Ok(Err(e)) => {
                                        full = true;
                                        Err(e)
                                    }
                                    Err(_) => {
                                        full = true;
                                        continue;
                                    }
                                }
                            }
                        },
                        MarkerView::Unavailable => {
                            relist_at = relist_at
                                .min(tokio::time::Instant::now() + jittered(FALLBACK_RELIST));
                            Ok(false)
                        }
                        MarkerView::Unknown => Ok(false),
                    }
                }
                _ = tokio::time::sleep_until(relist_at) => {
                    full = true;
                    continue;
                }
                _ = f.reads.notify.notified() => {
                    let want = f
                        .reads
                        .take()
                        .into_iter()
                        .filter(|(_, p)| p.starts_with(kind.prefix))
                        .map(|k| (k, 0));
                    match tokio::time::timeout_at(
                        relist_at,
                        read_some(&client, &kind, &trust, &rejected, &mut cache, want),
                    )
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => {
                            full = true;
                            continue;
                        }
                    }
                }
            }
        };
        match step {
            Ok(changed) => {
                attempt = 0;
                if let Some(tx) = &f.failing {
                    tx.send_if_modified(|e| e.take().is_some());
                }
                if changed {
                    rejected.replace_under(kind.prefix, rejections_of(&cache));
                    if tx.send(out(&cache)).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                if let Some(tx) = &f.failing {
                    let why = e.to_string();
                    tx.send_if_modified(|e| {
                        (e.as_ref() != Some(&why)).then(|| *e = Some(why)).is_some()
                    });
                }
                if let Some(failures) = failures.failed(std::time::Instant::now()) {
                    tracing::warn!(error = %e, prefix = kind.prefix, failures, "cannot read records; retrying after a backoff (logged at most once a minute)");
                }
                tokio::time::sleep(backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                    attempt,
                ))
                .await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}

/// Lists every record under the prefix and reads those whose ModifyIndex the cache lacks.
async fn list_all<T: Clone>(
    client: &Client,
    kind: &Kind<T>,
    trust: &RecordTrust,
    rejected: &Rejections,
    cache: &mut Cache<T>,
) -> Result<(), NomadError> {
    let list = client
        .list_variables(kind.prefix, "*", 0, Duration::ZERO)
        .await?;
    let mut seen = BTreeMap::new();
    for m in &list.value {
        let k = (m.namespace.clone(), m.path.clone());
        let entry = match cache.get(&k).filter(|(idx, _)| *idx == m.modify_index) {
            Some(c) => c.clone(),
            None => read_one(client, kind, trust, rejected, &k).await?,
        };
        seen.insert(k, entry);
    }
    *cache = seen;
    Ok(())
}

/// Reads the named records (`(namespace, path)` → the ModifyIndex a change announced, 0 when
/// asked for through [`Reads`]) unless the cache already holds that index or a later one (for
/// an ask: unless it holds the record at all), and only those that
/// name a record ([`crate::cluster::changes::check_target`]); true when the cache changed.
async fn read_some<T: Clone>(
    client: &Client,
    kind: &Kind<T>,
    trust: &RecordTrust,
    rejected: &Rejections,
    cache: &mut Cache<T>,
    names: impl Iterator<Item = ((String, String), u64)>,
) -> Result<bool, NomadError> {
    let mut wanted: BTreeMap<(String, String), u64> = BTreeMap::new();
    for (k, i) in names {
        let e = wanted.entry(k).or_insert(i);
        *e = (*e).max(i);
    }
    let mut changed = false;
    for (k, index) in wanted {
        if index > 0 && cache.get(&k).is_some_and(|(have, _)| *have >= index) {
            continue;
        }
        // Asked for through `Reads` (no index): the agent lacked the record when it asked;
        // one the cache now holds (a list read it meanwhile, e.g. the first list of a
        // restart, which the allocations' asks wait behind) reaches the agent with the next
        // catalogue. A refused one is read again.
        if index == 0 && cache.get(&k).is_some_and(|(_, rec)| rec.is_some()) {
            continue;
        }
        // Only a record's path in a valid namespace is read (the marker's lines are checked
        // when it is read; a path asked for through `Reads` here).
        if let Err(reason) = crate::cluster::changes::check_target(&k.0, &k.1) {
            tracing::warn!(
                namespace = %crate::escape::escape_control(&k.0),
                path = %crate::escape::escape_control(&k.1),
                reason = %crate::escape::escape_control(&reason),
                "not reading a record path that names no record"
            );
            continue;
        }
        let (idx, rec) = read_one(client, kind, trust, rejected, &k).await?;
        match rec {
            None => changed |= cache.remove(&k).is_some(),
            Some(rec) => {
                if cache.get(&k).is_none_or(|(have, _)| *have != idx) {
                    cache.insert(k, (idx, Some(rec)));
                    changed = true;
                }
            }
        }
    }
    Ok(changed)
}

/// Reads one record (`GET /v1/var/:path`) and checks it; `(0, None)` when it is gone. A
/// refusal is told to `rejected`'s observer (each record version is read once: the caches
/// skip an index they hold).
async fn read_one<T>(
    client: &Client,
    kind: &Kind<T>,
    trust: &RecordTrust,
    rejected: &Rejections,
    (namespace, path): &(String, String),
) -> Result<(u64, Option<Result<T, String>>), NomadError> {
    let Some(var) = client.variable(namespace, path).await? else {
        return Ok((0, None));
    };
    let rec = (kind.admit)(&var, trust).map_err(|r| {
        rejected.refused(r.reason);
        r.message
    });
    if let Err(reason) = &rec {
        (kind.refused)(namespace, path, reason);
    }
    Ok((var.modify_index, Some(rec)))
}

/// Follows the volume records (`dhv-binder/volumes/`) and sends a full catalogue after every
/// change: one list at start, then the records the change marker names (see `follow`).
pub async fn run(
    client: Client,
    follow_by: Follow,
    trust: RecordTrust,
    rejected: Rejections,
    tx: mpsc::Sender<Catalogue>,
) {
    let kind = Kind {
        prefix: RECORD_PREFIX,
        admit: |var, trust| admit(var, trust).map(Arc::new),
        refused: |namespace, path, reason| {
            let name = path.rsplit('/').next().unwrap_or(path);
            let volume = crate::escape::escape_control(&format!("{namespace}/{name}"));
            tracing::warn!(
                %volume,
                namespace = %crate::escape::escape_control(namespace),
                path = %crate::escape::escape_control(path),
                reason = %crate::escape::escape_control(reason),
                "refusing a volume record: nothing is mounted, created or deleted for it"
            );
        },
    };
    follow(client, kind, follow_by, trust, rejected, catalogue_of, tx).await
}

/// A catalogue of `records` (tests build theirs from plain records).
#[cfg(test)]
pub(crate) fn shared(records: BTreeMap<VolumeKey, VolumeRecord>) -> Catalogue {
    records.into_iter().map(|(k, r)| (k, Arc::new(r))).collect()
}

fn catalogue_of(cache: &Cache<Arc<VolumeRecord>>) -> Catalogue {
    cache
        .values()
        .filter_map(|(_, r)| r.clone().and_then(Result::ok))
        .map(|r| (r.key(), r))
        .collect()
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
pub fn admit(var: &Variable, trust: &RecordTrust) -> Result<VolumeRecord, Refusal> {
    crate::cluster::trust::admit(var, trust, VolumeRecord::from_variable)
}

#[cfg(test)]
mod tests {
    use super::*;

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
