//! The change marker: one small variable, [`MARKER_PATH`] in namespace [`MARKER_NAMESPACE`],
//! that every writer of a volume or snapshot record updates after its write (check-and-set,
//! retried on conflict), carrying a sequence number and a ring of the last [`RING`] changes
//! (the record's namespace, path and ModifyIndex).
//!
//! Agents follow it with a blocking read of that one variable (Nomad API:
//! `GET /v1/var/dhv-binder/records-changed?index=N`), which Nomad answers only when the marker
//! itself changes (`nomad/variables_endpoint.go` `Variables.Read` answers with the variable's
//! ModifyIndex and `blockingRPC` waits until it passes `index`), not on every variable write
//! as a prefix list does. On a change an agent reads only the records the ring names since
//! the sequence number it last saw, or lists them all when the ring no longer reaches back
//! that far ([`Marker::since`]). Node records, claims and other applications' variables do
//! not touch the marker, so they wake no agent (docs/records.md, "The change marker").
//!
//! The marker is a hint, not a record: what an agent acts on is still the record it reads,
//! verified as every record is (`cluster::trust`). A marker that lies or is never updated
//! (a writer that does not bump it: an older CLI, `nomad var put`) costs reads or delays a
//! record until the next safety relist; it cannot make a node act on a record. Every line is
//! checked before anything is read for it ([`check_target`]): a valid namespace name and a
//! record's path (the volume prefix and an encoded volume name, or the snapshot prefix and a
//! snapshot ID), nothing else; a line that fails is logged, counted
//! (`dhv_binder_records_refused_total{reason="marker-line"}`) and skipped, and no request
//! leaves for it.

use crate::cluster::trust::RefusedReason;
use crate::nomad::types::Variable;
use crate::nomad::watch::MIN_QUERY_INTERVAL;
use crate::nomad::{Client, NomadError};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// The snapshot records' variable prefix (`cluster::snapshot::SNAPSHOT_PREFIX`, a module that
/// imports this one).
const SNAPSHOT_RECORDS: &str = "dhv-binder/snapshots/";
/// The forced-unpublish requests' variable prefix
/// (`cluster::unpublish_request::REQUEST_PREFIX`).
const UNPUBLISH_REQUESTS: &str = "dhv-binder/unpublish-requests/";

/// Checks that a change names a record: `namespace` a valid namespace name
/// ([`crate::volume::validate_identifier`]) and `path` a volume record's path
/// ([`crate::volume::RECORD_PREFIX`] and the encoded name of a valid volume name, as
/// [`crate::volume::record_path`] writes it) or a snapshot record's (the snapshot prefix and
/// a lower-case hyphenated UUID); a forced-unpublish request's path is checked as a volume
/// record's, under its own prefix. `Err` says why not. Nothing else is ever read for a
/// marker line or asked to be read.
pub fn check_target(namespace: &str, path: &str) -> Result<(), String> {
    crate::volume::validate_identifier("namespace", namespace, false).map_err(|e| e.to_string())?;
    if let Some(encoded) = path
        .strip_prefix(crate::volume::RECORD_PREFIX)
        .or_else(|| path.strip_prefix(UNPUBLISH_REQUESTS))
    {
        let name = decode_name(encoded)
            .ok_or_else(|| format!("{encoded:?} is not an encoded volume name"))?;
        crate::volume::validate_identifier("name", &name, true).map_err(|e| e.to_string())?;
        if crate::volume::encode_name(&name) != encoded {
            return Err(format!("{encoded:?} is not how a volume name is encoded"));
        }
        return Ok(());
    }
    if let Some(id) = path.strip_prefix(SNAPSHOT_RECORDS) {
        return if crate::volume::is_alloc_id(id) {
            Ok(())
        } else {
            Err(format!("{id:?} is not a snapshot ID"))
        };
    }
    Err(format!(
        "{path:?} is not under {}, {SNAPSHOT_RECORDS} or {UNPUBLISH_REQUESTS}",
        crate::volume::RECORD_PREFIX
    ))
}

/// The name [`crate::volume::encode_name`] encoded: `~xx` back to its byte; `None` when the
/// text holds other bytes than the encoding writes or is no UTF-8.
pub fn decode_name(encoded: &str) -> Option<String> {
    let mut out = Vec::with_capacity(encoded.len());
    let mut bytes = encoded.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'~' => {
                let hex = [bytes.next()?, bytes.next()?];
                let hex = std::str::from_utf8(&hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
            }
            b if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' => out.push(b),
            _ => return None,
        }
    }
    String::from_utf8(out).ok()
}

/// The marker's variable path.
pub const MARKER_PATH: &str = "dhv-binder/records-changed";
/// The marker's namespace (records live in their volume's namespace; the marker is one).
pub const MARKER_NAMESPACE: &str = "default";
/// How many changes the marker keeps (the ring). An agent that missed more lists all records.
pub const RING: usize = 16;
/// Most check-and-set attempts of one update before it gives up (each conflict means another
/// writer's update landed: the marker moved on, this writer's change is not lost by retrying).
const MAX_ATTEMPTS: u32 = 20;

/// One record change: `seq` is the marker's sequence number given to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The marker's sequence number of this change (1, 2, ...).
    pub seq: u64,
    /// The record's ModifyIndex after the write (0: deleted, or not known).
    pub index: u64,
    /// The record's namespace.
    pub namespace: String,
    /// The record's variable path (`dhv-binder/volumes/<name>`, `dhv-binder/snapshots/<id>`).
    pub path: String,
}

/// The marker as read: its identity (the variable's CreateIndex, which a delete and re-create
/// changes), its sequence number and the last changes, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marker {
    /// The variable's CreateIndex (0 before it was written).
    pub epoch: u64,
    /// The variable's ModifyIndex (what a blocking read waits past).
    pub modify_index: u64,
    /// The sequence number of the last change (0: none yet).
    pub seq: u64,
    /// At most [`RING`] changes, oldest first, the last one numbered `seq`.
    pub ring: VecDeque<Change>,
    /// The variable did not decode (someone else wrote it): every follower lists all records.
    pub malformed: bool,
}

/// Where a follower is in the marker's sequence: the marker's identity and the last
/// sequence number whose change it has read (or listed past).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// [`Marker::epoch`] when it was seen.
    pub epoch: u64,
    /// [`Marker::seq`] when it was seen.
    pub seq: u64,
}

/// What a follower must do about a marker it has just read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Since {
    /// Nothing changed since what it saw.
    Nothing,
    /// These changes (oldest first) are all that happened since.
    Changes(Vec<Change>),
    /// More happened than the ring holds, or the marker was re-created, restored or garbled:
    /// list every record.
    Gap,
}

impl Marker {
    /// Decodes the marker variable (`Items`: `seq`, and `changes`, one line per change:
    /// `<seq> <index> <namespace> <path>`, oldest first). Variable paths and namespaces have
    /// no spaces (`[a-zA-Z0-9-_~/]`), so the lines split unambiguously.
    pub fn from_variable(var: &Variable) -> Result<Marker, String> {
        let seq: u64 = var
            .items
            .get("seq")
            .ok_or("no seq")?
            .parse()
            .map_err(|e| format!("seq: {e}"))?;
        let mut ring = VecDeque::new();
        for line in var
            .items
            .get("changes")
            .map(String::as_str)
            .unwrap_or("")
            .lines()
        {
            let mut f = line.split(' ');
            let (Some(s), Some(i), Some(ns), Some(path), None) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                return Err(format!("change line {line:?}"));
            };
            ring.push_back(Change {
                seq: s.parse().map_err(|e| format!("change seq: {e}"))?,
                index: i.parse().map_err(|e| format!("change index: {e}"))?,
                namespace: ns.to_string(),
                path: path.to_string(),
            });
        }
        let ordered = ring
            .iter()
            .zip(ring.iter().skip(1))
            .all(|(a, b)| b.seq == a.seq + 1);
        if !ordered || ring.back().is_some_and(|c| c.seq != seq) || ring.len() > RING {
            return Err("changes out of sequence".into());
        }
        Ok(Marker {
            epoch: var.create_index,
            modify_index: var.modify_index,
            seq,
            ring,
            malformed: false,
        })
    }

    /// The marker as it is read, or a malformed one (every follower lists all) when it does
    /// not decode; its identity is kept so that the next good write is a change.
    pub fn read(var: &Variable) -> Marker {
        Marker::from_variable(var).unwrap_or_else(|reason| {
            tracing::warn!(
                path = MARKER_PATH,
                reason = %crate::escape::escape_control(&reason),
                "the record change marker does not decode: records are listed in full until a writer replaces it"
            );
            Marker {
                epoch: var.create_index,
                modify_index: var.modify_index,
                malformed: true,
                ..Marker::default()
            }
        })
    }

    /// The variable that stores this marker.
    pub fn to_variable(&self) -> Variable {
        let changes: Vec<String> = self
            .ring
            .iter()
            .map(|c| format!("{} {} {} {}", c.seq, c.index, c.namespace, c.path))
            .collect();
        let mut items = BTreeMap::new();
        items.insert("seq".to_string(), self.seq.to_string());
        items.insert("changes".to_string(), changes.join("\n"));
        Variable {
            namespace: MARKER_NAMESPACE.into(),
            path: MARKER_PATH.into(),
            create_index: self.epoch,
            modify_index: self.modify_index,
            items,
            lock: None,
        }
    }

    /// Adds one change under the next sequence number, dropping the oldest beyond [`RING`].
    pub fn push(&mut self, namespace: &str, path: &str, index: u64) {
        self.seq += 1;
        self.ring.push_back(Change {
            seq: self.seq,
            index,
            namespace: namespace.to_string(),
            path: path.to_string(),
        });
        while self.ring.len() > RING {
            self.ring.pop_front();
        }
    }

    /// Where a follower that has read everything up to this marker stands.
    pub fn seen(&self) -> Seen {
        Seen {
            epoch: self.epoch,
            seq: self.seq,
        }
    }

    /// What happened since `seen` (`None`: the follower has no base yet, it lists).
    pub fn since(&self, seen: Option<Seen>) -> Since {
        let Some(seen) = seen else {
            return Since::Gap;
        };
        if self.malformed || seen.epoch != self.epoch || seen.seq > self.seq {
            return Since::Gap;
        }
        if seen.seq == self.seq {
            return Since::Nothing;
        }
        // The ring must hold every change after `seen.seq`, starting with the next one.
        // Lines that name no record ([`Marker::refused`]) are skipped.
        match self.ring.front() {
            Some(first) if first.seq <= seen.seq + 1 => Since::Changes(
                self.ring
                    .iter()
                    .filter(|c| c.seq > seen.seq)
                    .filter(|c| check_target(&c.namespace, &c.path).is_ok())
                    .cloned()
                    .collect(),
            ),
            _ => Since::Gap,
        }
    }

    /// The lines of the ring that name no record ([`check_target`]), with why: never read,
    /// never followed.
    pub fn refused(&self) -> Vec<(&Change, String)> {
        self.ring
            .iter()
            .filter_map(|c| check_target(&c.namespace, &c.path).err().map(|r| (c, r)))
            .collect()
    }
}

/// Records that `path` in `namespace` was written (ModifyIndex `index`; 0 after a delete) in
/// the marker: read it, add the change, write it back with check-and-set on its ModifyIndex
/// (`?cas=`), and on a conflict (another writer's update landed first) read it again and
/// retry, with a short random pause. Returns the change's sequence number.
///
/// Errors: the reads' and writes' [`NomadError`]s (permission: the token lacks `read` and
/// `write` on [`MARKER_PATH`] in `default`, see jobspecs/*-policy.hcl), or
/// [`NomadError::CasConflict`] after 20 conflicts in a row.
pub async fn announce(
    client: &Client,
    namespace: &str,
    path: &str,
    index: u64,
) -> Result<u64, NomadError> {
    let mut attempt = 0u32;
    loop {
        let current = client.variable(MARKER_NAMESPACE, MARKER_PATH).await?;
        let (mut marker, cas) = match &current {
            Some(v) => {
                let mut m = Marker::read(v);
                if m.malformed {
                    // Start a fresh ring in the same variable, numbered past any sequence
                    // number it can have carried (each one was a write, so below its
                    // ModifyIndex): every follower sees a gap and lists.
                    m = Marker {
                        epoch: v.create_index,
                        modify_index: v.modify_index,
                        seq: v.modify_index,
                        ..Marker::default()
                    };
                }
                (m, v.modify_index)
            }
            None => (Marker::default(), 0),
        };
        marker.push(namespace, path, index);
        match client.put_variable(&marker.to_variable(), Some(cas)).await {
            Ok(_) => return Ok(marker.seq),
            Err(NomadError::CasConflict { .. }) if attempt + 1 < MAX_ATTEMPTS => {
                attempt += 1;
                let ceiling = 10u64.saturating_mul(1 << attempt.min(6));
                let pause = rand::random::<u64>() % ceiling.max(1);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// [`announce`] as a writer calls it after its record write: a failure is logged (warn) and
/// not returned, since the record itself is written; agents see it at their next full list
/// (the safety relist, `--record-relist`).
pub async fn announce_or_log(client: &Client, namespace: &str, path: &str, index: u64) {
    if let Err(e) = announce(client, namespace, path, index).await {
        tracing::warn!(
            error = %e,
            namespace = %crate::escape::escape_control(namespace),
            path = %crate::escape::escape_control(path),
            marker = MARKER_PATH,
            "the record is written but the change marker could not be updated: agents see the record at their next full list (--record-relist) instead of at once"
        );
    }
}

/// Writes a record (Nomad API: `PUT /v1/var/:path?cas=N`, see [`Client::put_variable`]) and
/// then announces it in the marker ([`announce_or_log`]). The record write's errors as
/// `put_variable`'s; a marker failure is only logged.
pub async fn put_record(
    client: &Client,
    var: &Variable,
    cas: Option<u64>,
) -> Result<Variable, NomadError> {
    let written = client.put_variable(var, cas).await?;
    announce_or_log(client, &var.namespace, &var.path, written.modify_index).await;
    Ok(written)
}

/// Deletes a record (Nomad API: `DELETE /v1/var/:path?cas=N`, see [`Client::delete_variable`])
/// and then announces it in the marker with index 0 ([`announce_or_log`]).
pub async fn delete_record(
    client: &Client,
    namespace: &str,
    path: &str,
    cas: Option<u64>,
) -> Result<(), NomadError> {
    client.delete_variable(namespace, path, cas).await?;
    announce_or_log(client, namespace, path, 0).await;
    Ok(())
}

/// The marker as the agent's followers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkerView {
    /// Not read yet.
    Unknown,
    /// Cannot be read (the token's policy lacks it): followers list on their fallback pace.
    Unavailable,
    /// The last marker read.
    Seen(Marker),
}

/// Told of each marker line refused ([`RefusedReason::MarkerLine`]), once per line.
pub type LineObserver = Arc<dyn Fn(RefusedReason) + Send + Sync>;

/// [`watch_observed`] with no one told of refused lines (they are still logged and skipped).
pub async fn watch(client: Client, wait: Duration, tx: tokio::sync::watch::Sender<MarkerView>) {
    watch_observed(client, wait, tx, Arc::new(|_| {})).await
}

/// Follows the marker with blocking reads of its one variable (`wait` per query; the next one
/// [`MIN_QUERY_INTERVAL`] after each answer, so a burst of changes is read as one) and publishes each
/// new state on `tx`. A missing marker is created empty (`cas=0`): a missing variable's
/// blocking read would wake on every variable write (Nomad answers it with the table index).
/// A marker that cannot be read or created for lack of permission makes the view
/// [`MarkerView::Unavailable`] (logged once), and is tried again every minute. Each line
/// that names no record ([`Marker::refused`]) is logged and told to `refused` once (the
/// followers skip it). Returns when every receiver is gone.
pub async fn watch_observed(
    client: Client,
    wait: Duration,
    tx: tokio::sync::watch::Sender<MarkerView>,
    refused: LineObserver,
) {
    // The last refused line told, by (marker epoch, sequence number): a line stays in the
    // ring for the next reads.
    let mut told = (0u64, 0u64);
    let mut index = 0u64;
    let mut attempt = 0u32;
    let mut warned = false;
    let mut failures = crate::nomad::retry::FailureLog::new(
        crate::nomad::retry::Call::ChangeMarker,
        crate::nomad::retry::LOG_EVERY,
    );
    loop {
        if tx.is_closed() {
            return;
        }
        let pause = match client
            .variable_blocking(MARKER_NAMESPACE, MARKER_PATH, index, wait)
            .await
        {
            Ok(r) => match r.value {
                Some(var) => {
                    attempt = 0;
                    // Wait on the marker's own index; after a restore it is lower, and the
                    // answer came at once: follow from there.
                    index = var.modify_index.max(1);
                    let m = Marker::read(&var);
                    for (c, reason) in m.refused() {
                        if m.epoch == told.0 && c.seq <= told.1 {
                            continue;
                        }
                        told = (m.epoch, c.seq);
                        refused(RefusedReason::MarkerLine);
                        tracing::warn!(
                            marker = MARKER_PATH,
                            seq = c.seq,
                            namespace = %crate::escape::escape_control(&c.namespace),
                            path = %crate::escape::escape_control(&c.path),
                            reason = %crate::escape::escape_control(&reason),
                            "a change marker line names no record: nothing is read for it (a writer of the marker wrote it; see docs/security.md)"
                        );
                    }
                    tx.send_if_modified(|v| {
                        let new = MarkerView::Seen(m);
                        let changed = *v != new;
                        *v = new;
                        changed
                    });
                    None
                }
                None => match client
                    .put_variable(&Marker::default().to_variable(), Some(0))
                    .await
                {
                    Ok(_) | Err(NomadError::CasConflict { .. }) => {
                        index = 0;
                        None
                    }
                    Err(e) => Some(e),
                },
            },
            Err(e) => Some(e),
        };
        if let Some(e) = pause {
            index = 0;
            let denied = matches!(
                e,
                NomadError::PermissionDenied { .. } | NomadError::Unauthorized { .. }
            );
            if denied {
                if !warned {
                    tracing::warn!(error = %e, marker = MARKER_PATH, "cannot follow the record change marker: records are listed every 10 s instead (apply the current jobspecs/dhv-binder-policy.hcl: read and write on dhv-binder/records-changed in namespace default)");
                    warned = true;
                }
                tx.send_if_modified(|v| {
                    let changed = *v != MarkerView::Unavailable;
                    *v = MarkerView::Unavailable;
                    changed
                });
                tokio::time::sleep(Duration::from_secs(60)).await;
            } else {
                if let Some(failures) = failures.failed(std::time::Instant::now()) {
                    tracing::warn!(error = %e, failures, "cannot read the record change marker; retrying after a backoff (logged at most once a minute)");
                }
                tokio::time::sleep(crate::nomad::retry::backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                    attempt,
                ))
                .await;
                attempt = attempt.saturating_add(1);
            }
            continue;
        }
        // The next read waits a query interval from this answer (not from the question, which
        // may have blocked for minutes): a burst of changes is read as one.
        tokio::time::sleep(MIN_QUERY_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker_with(n: u64) -> Marker {
        let mut m = Marker {
            epoch: 7,
            ..Marker::default()
        };
        for i in 0..n {
            m.push("default", &format!("dhv-binder/volumes/v{i}"), 100 + i);
        }
        m
    }

    #[test]
    fn the_ring_keeps_the_last_changes_in_sequence_and_round_trips() {
        let m = marker_with(RING as u64 + 5);
        assert_eq!(m.seq, RING as u64 + 5);
        assert_eq!(m.ring.len(), RING);
        assert_eq!(m.ring.front().unwrap().seq, 6);
        assert_eq!(
            m.ring.back().unwrap().path,
            format!("dhv-binder/volumes/v{}", RING + 4)
        );
        let mut var = m.to_variable();
        var.create_index = 7;
        var.modify_index = 42;
        let back = Marker::from_variable(&var).unwrap();
        assert_eq!(back.ring, m.ring);
        assert_eq!((back.seq, back.epoch, back.modify_index), (m.seq, 7, 42));
        // An empty marker (as agents create it) decodes too.
        assert_eq!(
            Marker::from_variable(&Marker::default().to_variable()).unwrap(),
            Marker::default()
        );
    }

    #[test]
    fn changes_since_what_was_seen_or_a_gap_when_the_ring_no_longer_reaches_back() {
        let m = marker_with(RING as u64 + 5); // holds seq 6 ..= RING + 5
        let at = |seq| {
            Some(Seen {
                epoch: 7,
                seq: seq as u64,
            })
        };
        assert_eq!(m.since(at(RING + 5)), Since::Nothing);
        match m.since(at(RING + 3)) {
            Since::Changes(c) => {
                assert_eq!(
                    c.iter().map(|c| c.seq).collect::<Vec<_>>(),
                    [RING as u64 + 4, RING as u64 + 5]
                )
            }
            other => panic!("{other:?}"),
        }
        // Seen up to 5: the ring starts at 6, so it covers everything since.
        assert!(matches!(m.since(at(5)), Since::Changes(c) if c.len() == RING));
        // Seen up to 4: change 5 has left the ring.
        assert_eq!(m.since(at(4)), Since::Gap);
        // No base yet, a re-created marker (another epoch), a sequence behind what was seen
        // (restored from a snapshot): list all.
        assert_eq!(m.since(None), Since::Gap);
        assert_eq!(m.since(Some(Seen { epoch: 8, seq: 6 })), Since::Gap);
        assert_eq!(m.since(at(RING + 9)), Since::Gap);
        // A garbled marker: list all.
        let mut var = m.to_variable();
        var.items.insert("changes".into(), "1 2 default".into());
        assert!(Marker::from_variable(&var).is_err());
        assert_eq!(Marker::read(&var).since(at(RING + 5)), Since::Gap);
        // Lines out of sequence are garbled too.
        let mut var = m.to_variable();
        let reversed: Vec<&str> = var.items["changes"].lines().rev().collect();
        let reversed = reversed.join("\n");
        var.items.insert("changes".into(), reversed);
        assert!(Marker::from_variable(&var).is_err());
    }

    /// Issue 44 #3: a marker line names a record or nothing is read for it: a query, dot
    /// segments, another endpoint, a stale alias, a namespace that is none.
    #[test]
    fn marker_lines_that_name_no_record_are_refused_and_skipped() {
        let snap = "dhv-binder/snapshots/0b9c6a6e-1111-4c2a-9d6e-2f1f3a4b5c6d";
        assert_eq!(check_target("default", "dhv-binder/volumes/data"), Ok(()));
        assert_eq!(
            check_target("team-a", "dhv-binder/volumes/db~5b0~5d"),
            Ok(())
        );
        assert_eq!(check_target("default", snap), Ok(()));
        for (ns, path) in [
            (
                "default",
                "dhv-binder/volumes/data?index=99999999&wait=300s",
            ),
            ("default", "dhv-binder/volumes/../../../acl/token/self"),
            ("default", "dhv-binder/volumes/data?x"),
            ("default", "dhv-binder/volumes/"),
            ("default", "dhv-binder/volumes/~2e~2e"),
            ("default", "dhv-binder/volumes/da~74a"),
            ("default", "dhv-binder/nodes/n1"),
            ("default", "dhv-binder/snapshots/not-a-uuid"),
            ("default", "other/path"),
            ("*", "dhv-binder/volumes/data"),
            ("a/b", "dhv-binder/volumes/data"),
            ("..", "dhv-binder/volumes/data"),
        ] {
            assert!(check_target(ns, path).is_err(), "{ns} {path}");
        }
        // A marker holding crafted lines decodes (its sequence is intact), but the lines are
        // refused and never among the changes to read.
        let mut m = marker_with(1);
        m.push(
            "default",
            "dhv-binder/volumes/x?index=99999999&wait=300s",
            5,
        );
        m.push("default", "dhv-binder/volumes/../../../acl/token/self", 6);
        m.push("default", "dhv-binder/volumes/v0?x", 7);
        m.push("default", "dhv-binder/volumes/fresh", 8);
        let back = Marker::from_variable(&m.to_variable()).unwrap();
        assert!(!back.malformed);
        let refused: Vec<u64> = back.refused().iter().map(|(c, _)| c.seq).collect();
        assert_eq!(refused, [2, 3, 4]);
        match back.since(Some(Seen { epoch: 7, seq: 1 })) {
            Since::Changes(c) => assert_eq!(
                c.iter().map(|c| c.path.as_str()).collect::<Vec<_>>(),
                ["dhv-binder/volumes/fresh"]
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_snapshot_prefix_is_the_snapshot_records() {
        assert_eq!(SNAPSHOT_RECORDS, crate::cluster::snapshot::SNAPSHOT_PREFIX);
    }
}
