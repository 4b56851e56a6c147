//! The durable local journal: which volumes this node has published where, and which
//! allocations use them.
//!
//! Two halves: [`Journal`] is the records in memory, changed by the agent core without I/O;
//! each change is queued, and [`Journal::take_commit`] gathers every change since the last
//! one into one [`Commit`] (group commit: all intents of a planning pass in one durable
//! write). [`Store`] writes a commit on a blocking thread off the agent's loop; the plugin
//! calls of a pass start only once their commit is durable. Outcome records
//! (`publish-done`, ...) need no sync of their own: they are appended unsynced and made
//! durable by the next synced commit; a crash before it leaves the intent, which replay
//! resolves by calling the idempotent operation again.
//!
//! Layout in the state directory:
//! - `journal.wal`: the changes since the snapshot, one line per commit
//!   (`{"seq":7,"sync":true,"mounts":[[<key>,<record or null>]],"users":[[<user>,<bool>]]}`),
//!   appended; a commit with intents is synced with one `fdatasync`, others are not (what
//!   unsynced bytes can lose is lost only with the machine: see [`Commit`]);
//! - `journal.json`: the whole state as of a `seq`, with its format version (`version`:
//!   2 is written; 1, without `seq`, is read; a newer one is refused, see [`VERSION`]), replaced atomically (temp file, fsync, rename, fsync of the directory) when
//!   the log has outgrown it (or 256 KiB) and after a failed write; the log is emptied
//!   then, so neither file grows with history;
//! - `journal.log`: the history, one JSON object per line, appended after each commit
//!   without a sync of its own (it is for operators and tests, never read back), rotated at
//!   16 MiB (`{"time":<unix s>,"unix_ms":<unix ms>,"event":"publish-done","volume":"ns/name",..}`).
//!   Lines a failed write could not append (a full or read-only state disk) are kept in
//!   memory and appended, in order and with the time of their commit, by the next write
//!   that succeeds; beyond [`UNLOGGED_MAX`] the oldest are dropped and a `history-lost`
//!   line says how many.
//!
//! Secrets never enter any of them.

use crate::volume::VolumeKey;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The format version of `journal.json` this build writes (the `version` field; the lines
/// of `journal.wal` are in the format of the snapshot they follow). Versions from
/// [`OLDEST_READ`] up to it are read; the first write after reading an older one rewrites
/// the snapshot in this version. A newer version is refused with
/// [`JournalError::NewerFormat`]. Releases: 0.1.0 writes 2. Each version has a fixture
/// under `testdata/journal/` that `tests/journal_format.rs` starts the agent on.
pub const VERSION: u32 = 2;
/// The oldest format version of `journal.json` this build reads (1: no `seq`, no
/// `journal.wal`).
pub const OLDEST_READ: u32 = 1;
const LOG_ROTATE_BYTES: u64 = 16 << 20;
/// History lines kept in memory while `journal.log` cannot be written (about 200 bytes
/// each); beyond it the oldest are dropped and counted.
pub const UNLOGGED_MAX: usize = 10_000;
/// The state directory's mode: only root reads the journal (issue 13 §5).
const DIR_MODE: u32 = 0o700;
/// The journal files' mode.
const FILE_MODE: u32 = 0o600;

/// Journal I/O failed, or the file on disk is not one this version can read.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot write journal {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read journal {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("journal {path} is corrupt ({reason}); it was left untouched: move it aside only after checking the mounts under the state directory")]
    Corrupt { path: PathBuf, reason: String },
    /// The journal was written by a newer dhv-binder (a downgrade): this build cannot know
    /// what its records mean, so it starts on nothing rather than on a guess.
    #[error("journal {path} has format version {found}, written by a newer dhv-binder; this build reads versions {oldest} to {newest}: run the newer release again (a downgrade needs every volume of this node unpublished first, then the state directory moved aside); the journal was left untouched")]
    NewerFormat {
        path: PathBuf,
        found: u32,
        oldest: u32,
        newest: u32,
    },
}

/// Where a volume's node-level mount stands. `Publishing` and `Unpublishing` are written
/// before the plugin call; finding one on start means the outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MountState {
    Publishing,
    Published,
    Unpublishing,
}

/// What a plugin's `publish` returned as `context` (any JSON; `null` when none), as a mount
/// record keeps it: written and read as that JSON, kept boxed and only when not `null`.
/// Most plugins return none, and a JSON value in place is 72 bytes: boxed, a record fits
/// the allocator's 256-byte class rather than the 384-byte one (docs/scale.md, memory per
/// allocation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublishContext(Option<Box<serde_json::Value>>);

impl PublishContext {
    /// The context (`null` when none).
    pub fn value(&self) -> &serde_json::Value {
        static NULL: serde_json::Value = serde_json::Value::Null;
        self.0.as_deref().unwrap_or(&NULL)
    }
}

impl From<serde_json::Value> for PublishContext {
    fn from(v: serde_json::Value) -> Self {
        Self((!v.is_null()).then(|| Box::new(v)))
    }
}

impl Serialize for PublishContext {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for PublishContext {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde_json::Value::deserialize(d).map(Self::from)
    }
}

/// The record of one volume's mount on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MountRecord {
    pub volume: VolumeKey,
    pub volume_id: String,
    pub plugin_id: String,
    pub state: MountState,
    /// The placeholder path the plugin mounts onto. Unpublish uses this stored path,
    /// never one recomputed from a job.
    pub target: PathBuf,
    pub read_only: bool,
    /// What the plugin's `publish` returned as `context`; handed back to `unpublish`.
    #[serde(default)]
    pub publish_context: PublishContext,
    /// Unix seconds of the last state change.
    pub since: u64,
    /// Last plugin error, if the last attempt failed.
    #[serde(default)]
    pub last_error: String,
    /// The lock ID of this node's claim (single-node access modes), kept so that a restarted
    /// agent can renew it, or learn that it lost it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_id: Option<Box<str>>,
    /// What the last successful publish mounted at the target (device, root, type,
    /// source), read from the host's mount table: "published" means this stands there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount: Option<crate::node::mounts::MountIdentity>,
}

/// One allocation's use of one published volume.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UserKey {
    /// Shared: the user records, their index by volume and the store's copy hold one
    /// allocation ID between them (docs/scale.md, memory per allocation).
    pub alloc_id: Arc<str>,
    pub volume: VolumeKey,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct OnDisk {
    version: u32,
    node_id: String,
    /// The last change line of `journal.wal` this snapshot holds (version 2).
    #[serde(default)]
    seq: u64,
    mounts: Vec<MountRecord>,
    users: Vec<UserKey>,
}

/// [`OnDisk`] borrowed from the store's copy of the records (the same JSON).
#[derive(Serialize)]
struct OnDiskRef<'a> {
    version: u32,
    node_id: &'a str,
    seq: u64,
    mounts: Vec<&'a MountRecord>,
    users: Vec<&'a UserKey>,
}

/// The records changed since the previous commit: the later state of each wins (`None`:
/// the mount record was removed; `false`: the user record was removed).
#[derive(Debug, Default)]
struct Delta {
    mounts: BTreeMap<VolumeKey, Option<Arc<MountRecord>>>,
    users: BTreeMap<UserKey, bool>,
}

/// The store's own copy of the records, kept current by the commits' deltas, so the loop
/// hands over only what changed and the whole state is serialised off the loop.
#[derive(Debug, Default)]
struct Records {
    /// The commits' records themselves, by volume (the key is the record's own).
    mounts: BTreeSet<ByVolume>,
    users: BTreeSet<UserKey>,
}

impl Records {
    fn apply(&mut self, d: &Delta) {
        for (k, m) in &d.mounts {
            match m {
                Some(m) => {
                    self.mounts.replace(ByVolume(m.clone()));
                }
                None => {
                    self.mounts.remove(k);
                }
            }
        }
        for (u, present) in &d.users {
            if *present {
                self.users.insert(u.clone());
            } else {
                self.users.remove(u);
            }
        }
    }
}

/// What happened to a record, as written to `journal.log` (`event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    PublishIntent,
    PublishDone,
    PublishFailed,
    UnpublishIntent,
    UnpublishDone,
    UnpublishFailed,
    UserAdded,
    UserRemoved,
    /// The claim's lease was about to end without a renewal: the volume is fenced here.
    Fenced,
    /// A fenced claim was renewed: the volume is published again here.
    Unfenced,
    /// This node took the claim over: the plugin's `fence_node` revoked the old holder's
    /// access at the storage (and `unfence_node` restored this node's) before the publish.
    NodeFenced,
    /// This node took a claim it held last (or was listed as fenced) without taking it from
    /// another node: the plugin's `unfence_node` restored this node's access at the storage
    /// (no other node was fenced).
    NodeUnfenced,
    /// An operator released this node's claim (a verified `volume claim release` mark): the
    /// volume is fenced here at once.
    ClaimReleased,
    /// An operator's forced unpublish on this node (a verified `volume unpublish -node N
    /// -force` request): who asked, whether the holders were killed, and what became of it.
    ForcedUnpublish,
}

impl EventKind {
    /// The name in `journal.log`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::PublishIntent => "publish-intent",
            EventKind::PublishDone => "publish-done",
            EventKind::PublishFailed => "publish-failed",
            EventKind::UnpublishIntent => "unpublish-intent",
            EventKind::UnpublishDone => "unpublish-done",
            EventKind::UnpublishFailed => "unpublish-failed",
            EventKind::UserAdded => "user-added",
            EventKind::UserRemoved => "user-removed",
            EventKind::Fenced => "fenced",
            EventKind::Unfenced => "unfenced",
            EventKind::NodeFenced => "node-fenced",
            EventKind::NodeUnfenced => "node-unfenced",
            EventKind::ClaimReleased => "claim-released",
            EventKind::ForcedUnpublish => "forced-unpublish",
        }
    }
}

/// The most recent events [`Journal::recent`] keeps per volume.
pub const RECENT_PER_VOLUME: usize = 10;
/// The most volumes [`Journal::recent`] keeps events of (those with the latest events).
pub const RECENT_VOLUMES: usize = 8;

/// One outcome in a volume's recent history on this node (in memory since the agent
/// started; the full history is `journal.log`): a publish, unpublish, fence or unfence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recent {
    /// Unix seconds.
    pub time: u64,
    /// `PublishDone`, `PublishFailed`, `UnpublishDone`, `UnpublishFailed`, `Fenced` or
    /// `Unfenced`.
    pub kind: EventKind,
    /// The allocation whose publish intent the outcome ends; `None` for the others.
    pub alloc_id: Option<String>,
    /// How long the call took, measured ([`Journal::measured`]); 0 when not measured.
    pub ms: u64,
    /// What the outcome is about beyond its kind ([`Journal::describe_last`]); empty when
    /// nothing.
    pub detail: String,
    /// The outcome failed although its kind does not say so (a refused forced unpublish).
    pub failed: bool,
}

/// One history line.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub kind: EventKind,
    pub volume: VolumeKey,
    pub alloc_id: Option<String>,
    pub detail: serde_json::Value,
}

/// Every change since the previous commit: the records that changed (O(changes), not
/// O(records): the store keeps the whole state), and the history lines.
#[derive(Debug)]
pub struct Commit {
    /// Increasing per journal; [`Store::write`] reports which commit became durable.
    pub seq: u64,
    delta: Delta,
    events: Vec<Event>,
    /// Must be synced before it counts as written: it carries intents. Nothing else is:
    /// unsynced bytes are lost only when the machine goes down, which ends every task and
    /// every mount of the node with it. What must outlive that is what a publish may have
    /// started beyond the machine (a remote disk attached, a claim held), so that the
    /// agent cleans it up: the intent. A lost outcome (`publish-done`, ...) leaves the
    /// intent, which replay resolves by calling the idempotent operation again; a lost user
    /// record names an allocation whose tasks died with the machine.
    durable: bool,
}

impl Commit {
    /// The history lines of this commit.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Folds a later commit into this one (the later state wins, history is kept in order):
    /// commits that queue while one is being written are written together.
    pub fn absorb(&mut self, later: Commit) {
        self.seq = later.seq;
        self.durable |= later.durable;
        self.delta.mounts.extend(later.delta.mounts);
        self.delta.users.extend(later.delta.users);
        self.events.extend(later.events);
    }
}

/// The mount records by volume. Each record is shared (`Arc`) between the loop's journal,
/// the pending commit and the store's copy: a change writes one record, never a copy per
/// holder (docs/scale.md, memory per allocation).
pub type Mounts = BTreeMap<VolumeKey, Arc<MountRecord>>;

/// A set entry that is a shared mount record, ordered, compared and looked up (`Borrow`)
/// by one of the record's fields alone: an index whose key is the record's own, not a copy.
macro_rules! record_by {
    ($(#[$doc:meta])* $name:ident, $field:ident: $key:ty) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        struct $name(Arc<MountRecord>);

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other).is_eq()
            }
        }

        impl Eq for $name {}

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        impl Ord for $name {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                let (a, b): (&$key, &$key) = (&self.0.$field, &other.0.$field);
                a.cmp(b)
            }
        }

        impl std::borrow::Borrow<$key> for $name {
            fn borrow(&self) -> &$key {
                &self.0.$field
            }
        }
    };
}

record_by!(
    /// A mount record in the journal's index by target.
    ByTarget, target: Path
);

record_by!(
    /// A mount record in the store's copy, by its volume.
    ByVolume, volume: VolumeKey
);

/// The journal's records in memory. Changes are queued for the next [`Commit`]; nothing
/// here performs I/O.
#[derive(Debug)]
pub struct Journal {
    node_id: String,
    mounts: Mounts,
    users: BTreeSet<UserKey>,
    /// Volume → the allocations recorded as its users (the same records as `users`).
    /// Each set is a sorted `Vec`: most volumes have one user, and a `BTreeSet` would
    /// allocate a node of eleven slots for it (docs/scale.md, memory per allocation).
    users_by_volume: BTreeMap<VolumeKey, Vec<Arc<str>>>,
    /// The mount records by target (the same records as `mounts`, shared: an index entry
    /// is a pointer, not a copy of the target and the volume's key; docs/scale.md, memory
    /// per allocation).
    targets: BTreeSet<ByTarget>,
    /// The (target, volume) pairs whose mount record changed or went since the last
    /// [`Journal::take_touched`]: what the agent checks against the mount table again.
    touched: BTreeSet<(PathBuf, VolumeKey)>,
    /// The records changed since the last [`Journal::take_commit`].
    pending: Delta,
    events: Vec<Event>,
    dirty: bool,
    /// The pending changes include intents (see [`Commit`]).
    durable: bool,
    seq: u64,
    /// Each volume's recent outcomes, oldest first, bounded ([`RECENT_PER_VOLUME`],
    /// [`RECENT_VOLUMES`]): what the node record shows (`volume status -verbose`).
    recent: BTreeMap<VolumeKey, std::collections::VecDeque<Recent>>,
    /// The allocation of each volume's last publish intent, named by its outcome.
    intent_alloc: BTreeMap<VolumeKey, String>,
}

/// The user records of `key` in a volume → allocations index
/// ([`Journal::users_by_volume`]), in allocation order.
pub fn users_of<'a>(
    by_volume: &'a BTreeMap<VolumeKey, Vec<Arc<str>>>,
    key: &'a VolumeKey,
) -> impl Iterator<Item = UserKey> + 'a {
    by_volume
        .get(key)
        .into_iter()
        .flatten()
        .map(move |alloc_id| UserKey {
            alloc_id: alloc_id.clone(),
            volume: key.clone(),
        })
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Journal {
    /// An empty journal for `node_id` (tests; the agent opens one with [`Store::open`]).
    pub fn new(node_id: &str) -> Self {
        Self {
            node_id: node_id.to_string(),
            mounts: BTreeMap::new(),
            users: BTreeSet::new(),
            users_by_volume: BTreeMap::new(),
            targets: BTreeSet::new(),
            touched: BTreeSet::new(),
            pending: Delta::default(),
            events: Vec::new(),
            dirty: false,
            durable: false,
            seq: 0,
            recent: BTreeMap::new(),
            intent_alloc: BTreeMap::new(),
        }
    }

    /// Each volume's recent publish, unpublish and fence outcomes on this node, oldest
    /// first (since the agent started; bounded by [`RECENT_PER_VOLUME`] and
    /// [`RECENT_VOLUMES`]).
    pub fn recent(&self) -> &BTreeMap<VolumeKey, std::collections::VecDeque<Recent>> {
        &self.recent
    }

    /// Records how long the call behind `key`'s latest outcome took (`ms`, measured by the
    /// caller around the plugin call).
    pub fn measured(&mut self, key: &VolumeKey, ms: u64) {
        if let Some(last) = self.recent.get_mut(key).and_then(|r| r.back_mut()) {
            last.ms = ms;
        }
    }

    /// Describes `key`'s latest outcome in its recent history (`volume status -verbose`'s
    /// detail column): who asked for a forced unpublish, what it killed; `failed` when it
    /// was refused.
    pub fn describe_last(&mut self, key: &VolumeKey, detail: String, failed: bool) {
        if let Some(last) = self.recent.get_mut(key).and_then(|r| r.back_mut()) {
            last.detail = detail;
            last.failed = failed;
        }
    }

    /// Keeps `kind` in `volume`'s recent history when it is an outcome worth showing.
    fn remember(&mut self, kind: EventKind, volume: &VolumeKey, alloc: Option<&str>) {
        let alloc_id = match kind {
            EventKind::PublishIntent => {
                if let Some(a) = alloc {
                    self.intent_alloc.insert(volume.clone(), a.to_string());
                }
                return;
            }
            // Every publish has its intent: the outcome takes the allocation's ID (kept
            // after it, it would cost an ID and a key per published volume).
            EventKind::PublishDone | EventKind::PublishFailed => self.intent_alloc.remove(volume),
            EventKind::UnpublishDone => {
                self.intent_alloc.remove(volume);
                None
            }
            EventKind::UnpublishFailed
            | EventKind::Fenced
            | EventKind::Unfenced
            | EventKind::NodeFenced
            | EventKind::NodeUnfenced
            | EventKind::ClaimReleased
            | EventKind::ForcedUnpublish => None,
            EventKind::UnpublishIntent | EventKind::UserAdded | EventKind::UserRemoved => return,
        };
        if !self.recent.contains_key(volume) && self.recent.len() >= RECENT_VOLUMES {
            // The volume whose latest event is the oldest makes room.
            let oldest = self
                .recent
                .iter()
                .min_by_key(|(_, r)| r.back().map_or(0, |e| e.time))
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.recent.remove(&k);
            }
        }
        let r = self.recent.entry(volume.clone()).or_default();
        if r.len() >= RECENT_PER_VOLUME {
            r.pop_front();
        }
        r.push_back(Recent {
            time: now_secs(),
            kind,
            alloc_id,
            ms: 0,
            detail: String::new(),
            failed: false,
        });
    }

    /// Loads records (from disk), with their indexes.
    fn load(&mut self, mounts: Vec<Arc<MountRecord>>, users: Vec<UserKey>) {
        for m in mounts {
            self.targets.replace(ByTarget(m.clone()));
            self.mounts.insert(m.volume.clone(), m);
        }
        for u in users {
            self.index_user(&u, true);
            self.users.insert(u);
        }
    }

    fn index_user(&mut self, u: &UserKey, present: bool) {
        if present {
            let ids = self.users_by_volume.entry(u.volume.clone()).or_default();
            if let Err(i) = ids.binary_search(&u.alloc_id) {
                if ids.is_empty() {
                    ids.reserve_exact(1);
                }
                ids.insert(i, u.alloc_id.clone());
            }
        } else if let Some(ids) = self.users_by_volume.get_mut(&u.volume) {
            if let Ok(i) = ids.binary_search(&u.alloc_id) {
                ids.remove(i);
            }
            if ids.is_empty() {
                self.users_by_volume.remove(&u.volume);
            }
        }
    }

    /// Volume → the allocations recorded as its users (an index of [`Journal::users`]).
    pub fn users_by_volume(&self) -> &BTreeMap<VolumeKey, Vec<Arc<str>>> {
        &self.users_by_volume
    }

    /// The volumes allocation `alloc_id` is recorded as using.
    pub fn volumes_of<'a>(&'a self, alloc_id: &'a str) -> impl Iterator<Item = &'a VolumeKey> + 'a {
        let from = UserKey {
            alloc_id: alloc_id.into(),
            volume: VolumeKey {
                namespace: String::new().into(),
                name: String::new().into(),
            },
        };
        self.users
            .range(from..)
            .take_while(move |u| &*u.alloc_id == alloc_id)
            .map(|u| &u.volume)
    }

    /// The node these records are for.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The volume whose mount record targets `target`, if any.
    pub fn volume_at(&self, target: &Path) -> Option<&VolumeKey> {
        self.targets.get(target).map(|t| &t.0.volume)
    }

    /// All mount records.
    pub fn mounts(&self) -> &Mounts {
        &self.mounts
    }

    /// All (allocation, volume) users.
    pub fn users(&self) -> &BTreeSet<UserKey> {
        &self.users
    }

    /// Records a mount state change (intent or outcome) and queues `kind` for the history.
    pub fn set_mount(&mut self, mut rec: MountRecord, kind: EventKind, alloc: Option<&str>) {
        rec.since = now_secs();
        let detail = serde_json::json!({
            "target": rec.target, "read_only": rec.read_only, "error": rec.last_error,
        });
        let key = rec.volume.clone();
        self.touched.insert((rec.target.clone(), key.clone()));
        let rec = Arc::new(rec);
        self.pending.mounts.insert(key.clone(), Some(rec.clone()));
        if let Some(old) = self.mounts.insert(key.clone(), rec.clone()) {
            if rec.target != old.target {
                self.targets.remove(old.target.as_path());
                self.touched.insert((old.target.clone(), key.clone()));
            }
        }
        // The new record replaces the old one in the index too (it would keep it alive).
        self.targets.replace(ByTarget(rec));
        if matches!(kind, EventKind::PublishIntent | EventKind::UnpublishIntent) {
            self.durable = true;
        }
        self.queue(kind, &key, alloc, detail);
    }

    /// The (target, volume) pairs whose mount record was set or removed since the last
    /// call (a volume whose record is gone, or moved to another target, is listed with the
    /// old target).
    pub fn take_touched(&mut self) -> BTreeSet<(PathBuf, VolumeKey)> {
        std::mem::take(&mut self.touched)
    }

    /// Queues a history line that changes no record (`fenced`, `unfenced`); it is written
    /// with the next commit.
    pub fn note(&mut self, kind: EventKind, volume: &VolumeKey, detail: serde_json::Value) {
        self.queue(kind, volume, None, detail);
    }

    /// Removes a volume's mount record (after a successful unpublish), and the volume's user
    /// records with it: no user record outlives its mount record (a lost claim unpublishes
    /// under running users; they are recorded again on the next publish; issue 13 §4).
    pub fn remove_mount(&mut self, key: &VolumeKey, kind: EventKind) {
        if let Some(old) = self.mounts.remove(key) {
            self.targets.remove(old.target.as_path());
            self.touched.insert((old.target.clone(), key.clone()));
            self.pending.mounts.insert(key.clone(), None);
            self.queue(kind, key, None, serde_json::Value::Null);
        }
        // Through the index: the volume's own users, not a pass over every user record.
        let stale: Vec<UserKey> = users_of(&self.users_by_volume, key).collect();
        self.change_users(&[], &stale);
    }

    /// Adds and removes user records (one commit for a whole plan, however many
    /// allocations start or stop at once). They need no sync of their own (see
    /// [`Commit`]).
    pub fn change_users(&mut self, add: &[UserKey], remove: &[UserKey]) {
        for u in add {
            if self.users.insert(u.clone()) {
                self.pending.users.insert(u.clone(), true);
                self.index_user(u, true);
                self.queue(
                    EventKind::UserAdded,
                    &u.volume,
                    Some(&u.alloc_id),
                    serde_json::Value::Null,
                );
            }
        }
        for u in remove {
            if self.users.remove(u) {
                self.pending.users.insert(u.clone(), false);
                self.index_user(u, false);
                self.queue(
                    EventKind::UserRemoved,
                    &u.volume,
                    Some(&u.alloc_id),
                    serde_json::Value::Null,
                );
            }
        }
    }

    fn queue(
        &mut self,
        kind: EventKind,
        volume: &VolumeKey,
        alloc: Option<&str>,
        detail: serde_json::Value,
    ) {
        self.dirty = true;
        self.remember(kind, volume, alloc);
        self.events.push(Event {
            kind,
            volume: volume.clone(),
            alloc_id: alloc.map(str::to_string),
            detail,
        });
    }

    /// True when changes wait for a commit.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Every change since the last commit, or `None` when nothing changed.
    pub fn take_commit(&mut self) -> Option<Commit> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        self.seq += 1;
        Some(Commit {
            durable: std::mem::take(&mut self.durable),
            seq: self.seq,
            delta: std::mem::take(&mut self.pending),
            events: std::mem::take(&mut self.events),
        })
    }

    /// Marks the state as changed again (a commit failed: the next one writes it all).
    pub fn redo(&mut self) {
        self.dirty = true;
    }
}

/// The journal's files, and a count of the syncs they cost.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    node_id: String,
    /// The files' state and the store's copy of the records (the journal's, kept by the
    /// commits' deltas): what a compaction serialises whole.
    disk: Arc<std::sync::Mutex<Disk>>,
    syncs: Arc<AtomicU64>,
    commits: Arc<AtomicU64>,
}

/// What the store knows of its files. Guarded by one lock: writes are serial.
#[derive(Debug, Default)]
struct Disk {
    records: Records,
    /// The sequence number of the last change line (or of the snapshot, if none since).
    seq: u64,
    /// `journal.wal`, open for appending.
    wal: Option<File>,
    /// Bytes in `journal.wal` (all after the snapshot).
    wal_bytes: u64,
    /// Bytes of the last `journal.json` written.
    snapshot_bytes: u64,
    /// The next write replaces `journal.json` and empties `journal.wal`: set when a write
    /// failed (a line may be torn, or missing), and when the log had a torn tail on open.
    compact: bool,
    /// History lines of commits whose write failed, not yet in `journal.log`, oldest
    /// first (each ends with a newline), and how many were dropped beyond
    /// [`UNLOGGED_MAX`].
    unlogged: std::collections::VecDeque<String>,
    dropped: u64,
}

/// One line of `journal.wal`: the records changed by one commit (the later state of each:
/// `None` removes the mount record, `false` the user record).
#[derive(Debug, Serialize, Deserialize)]
struct WalLine {
    seq: u64,
    /// True when this line was synced (it carried intents): every byte before it is
    /// durable too, so an unreadable line before it is corruption, not a torn tail.
    #[serde(default)]
    sync: bool,
    #[serde(default)]
    mounts: Vec<(VolumeKey, Option<MountRecord>)>,
    #[serde(default)]
    users: Vec<(UserKey, bool)>,
}

/// `journal.wal` is compacted into `journal.json` once it holds more than this many
/// bytes, or more than the snapshot itself (amortised: O(1) serialised bytes per change).
const COMPACT_MIN_BYTES: u64 = 256 << 10;

/// The journal's current state as stored (`journal.json` with `journal.wal` applied), read
/// without changing anything: for tests and operators' tools.
#[derive(Debug, Serialize)]
pub struct StoredState {
    pub node_id: String,
    pub mounts: Vec<MountRecord>,
    pub users: Vec<UserKey>,
}

/// Reads the state stored in `dir` (`journal.json`, then the changes of `journal.wal`),
/// changing nothing. Errors: [`JournalError::Read`] when a file cannot be read,
/// [`JournalError::Corrupt`] as [`Store::open`] would refuse it.
pub fn read_stored(dir: &Path) -> Result<StoredState, JournalError> {
    let (disk, node_id) = load(dir)?;
    Ok(StoredState {
        node_id,
        mounts: disk
            .records
            .mounts
            .into_iter()
            .map(|m| Arc::unwrap_or_clone(m.0))
            .collect(),
        users: disk.records.users.into_iter().collect(),
    })
}

/// The records in `dir` (`journal.json`, then `journal.wal`) with the node ID they were
/// written for. No `journal.json`: [`JournalError::Read`] with `NotFound`.
fn load(dir: &Path) -> Result<(Disk, String), JournalError> {
    let path = dir.join("journal.json");
    let corrupt = |path: &Path, reason: String| JournalError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let mut disk = Disk::default();
    let node_id;
    let wal_path = dir.join("journal.wal");
    let wal = match fs::read(&wal_path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => {
            return Err(JournalError::Read {
                path: wal_path,
                source,
            })
        }
    };
    match fs::read(&path) {
        Ok(bytes) => {
            // The version first: a newer format's records need not parse as this one's.
            #[derive(Deserialize)]
            struct Versioned {
                version: u32,
            }
            let v: Versioned =
                serde_json::from_slice(&bytes).map_err(|e| corrupt(&path, e.to_string()))?;
            if v.version > VERSION {
                return Err(JournalError::NewerFormat {
                    path,
                    found: v.version,
                    oldest: OLDEST_READ,
                    newest: VERSION,
                });
            }
            let d: OnDisk =
                serde_json::from_slice(&bytes).map_err(|e| corrupt(&path, e.to_string()))?;
            if d.version < OLDEST_READ {
                return Err(corrupt(
                    &path,
                    format!(
                        "format version {} (this build reads {OLDEST_READ} to {VERSION})",
                        d.version
                    ),
                ));
            }
            node_id = d.node_id;
            disk.seq = d.seq;
            disk.snapshot_bytes = bytes.len() as u64;
            disk.records.mounts = d
                .mounts
                .into_iter()
                .map(|m| ByVolume(Arc::new(m)))
                .collect();
            disk.records.users = d.users.into_iter().collect();
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !wal.is_empty() {
                return Err(corrupt(
                    &wal_path,
                    "it holds changes to a journal.json that is gone; move both aside together"
                        .into(),
                ));
            }
            return Err(JournalError::Read { path, source: e });
        }
        Err(source) => return Err(JournalError::Read { path, source }),
    }
    // The changes since the snapshot, in order. Lines after the last synced one may be
    // torn or missing after a crash (they hold outcomes only, which replay recovers by
    // calling the idempotent operation again): an unreadable line ends the log unless a
    // synced line follows it.
    let mut good = 0usize;
    let mut torn: Option<(usize, String)> = None;
    let mut at = 0usize;
    for (no, raw) in wal.split_inclusive(|b| *b == b'\n').enumerate() {
        at += raw.len();
        let parsed = if raw.ends_with(b"\n") {
            serde_json::from_slice::<WalLine>(raw).map_err(|e| e.to_string())
        } else {
            Err("no line end (torn write)".to_string())
        };
        match (parsed, &torn) {
            (Ok(line), Some((bad, why))) => {
                if line.sync {
                    return Err(corrupt(
                        &wal_path,
                        format!(
                            "line {} is unreadable ({why}) but a synced line follows it",
                            bad + 1
                        ),
                    ));
                }
            }
            (Ok(line), None) => {
                if line.seq <= disk.seq {
                    // Written before the snapshot that holds it (a compaction's truncate
                    // did not reach the disk).
                    good = at;
                    continue;
                }
                if line.seq != disk.seq + 1 {
                    return Err(corrupt(
                        &wal_path,
                        format!("line {} has seq {} after {}", no + 1, line.seq, disk.seq),
                    ));
                }
                disk.seq = line.seq;
                disk.records.apply(&Delta {
                    mounts: line
                        .mounts
                        .into_iter()
                        .map(|(k, m)| (k, m.map(Arc::new)))
                        .collect(),
                    users: line.users.into_iter().collect(),
                });
                good = at;
            }
            (Err(why), None) => torn = Some((no, why)),
            (Err(_), Some(_)) => {}
        }
    }
    disk.wal_bytes = good as u64;
    disk.compact = torn.is_some() || good < wal.len();
    Ok((disk, node_id))
}

impl Store {
    /// Opens (or creates) the journal in `dir` and loads its records (`journal.json`, then
    /// the changes in `journal.wal`). A corrupt file is an error, never discarded; a torn
    /// last line of the log (a crash while it was appended, before its sync) is dropped
    /// and the next write compacts.
    ///
    /// The directory is made mode 0700 and the journal's files 0600 (they name volumes,
    /// allocations and plugin errors; issue 13 §5), also when they exist already.
    pub fn open(dir: &Path, node_id: &str) -> Result<(Self, Journal), JournalError> {
        let private = |path: &Path, mode: u32| {
            fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|source| {
                JournalError::Write {
                    path: path.to_path_buf(),
                    source,
                }
            })
        };
        fs::create_dir_all(dir).map_err(|source| JournalError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        private(dir, DIR_MODE)?;
        for name in [
            "journal.json",
            "journal.wal",
            "journal.log",
            "journal.log.1",
        ] {
            let path = dir.join(name);
            if path.exists() {
                private(&path, FILE_MODE)?;
            }
        }
        let path = dir.join("journal.json");
        let mut j = Journal::new(node_id);
        let disk = match load(dir) {
            Ok((disk, on_disk)) => {
                if !on_disk.is_empty() && on_disk != node_id {
                    return Err(JournalError::Corrupt {
                        path,
                        reason: format!(
                            "written for node {on_disk} but this agent runs on node {node_id}"
                        ),
                    });
                }
                j.load(
                    disk.records.mounts.iter().map(|m| m.0.clone()).collect(),
                    disk.records.users.iter().cloned().collect(),
                );
                disk
            }
            Err(JournalError::Read { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                // A new journal: the first write makes journal.json and journal.wal.
                j.dirty = true;
                Disk {
                    compact: true,
                    ..Disk::default()
                }
            }
            Err(e) => return Err(e),
        };
        let store = Self {
            dir: dir.to_path_buf(),
            node_id: node_id.to_string(),
            disk: Arc::new(std::sync::Mutex::new(disk)),
            syncs: Arc::default(),
            commits: Arc::default(),
        };
        if let Some(c) = j.take_commit() {
            store.write(&c)?;
        }
        Ok((store, j))
    }

    /// fsync-class calls made so far (file and directory syncs).
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Commits written so far.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Writes `commit`: one line of its changes appended to `journal.wal`, synced
    /// (`fdatasync`) when the commit carries intents; any other commit is appended without
    /// a sync (see [`Commit`]). When the log has outgrown the snapshot (or a
    /// write failed before), the whole state replaces `journal.json` instead (temp file,
    /// fsync, rename, fsync of the directory) and the log is emptied. Then the history is
    /// appended to `journal.log` without a sync. Blocking: run it off the agent's loop.
    pub fn write(&self, commit: &Commit) -> Result<(), JournalError> {
        let mut disk = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        // The commit's changes go into the store's copy first: a write that fails leaves
        // the copy current, and the next write compacts it whole.
        disk.records.apply(&commit.delta);
        disk.seq += 1;
        let result = if disk.compact
            || disk.wal.is_none()
            || disk.wal_bytes > COMPACT_MIN_BYTES.max(disk.snapshot_bytes)
        {
            self.compact(&mut disk)
        } else {
            self.append(&mut disk, commit)
        };
        // The commit's history lines, stamped now, after those earlier writes could not
        // append: written together once a write succeeds, never lost with a failed one.
        let lines = history_lines(&commit.events);
        disk.unlogged.extend(lines);
        if disk.unlogged.len() > UNLOGGED_MAX {
            let over = disk.unlogged.len() - UNLOGGED_MAX;
            disk.unlogged.drain(..over);
            disk.dropped += over as u64;
        }
        if result.is_err() {
            disk.compact = true;
        }
        result?;
        self.commits.fetch_add(1, Ordering::Relaxed);
        let history = self.append_history(&mut disk);
        if history.is_err() {
            // The directory refuses writes by path (read-only, full): the next write
            // replaces the whole state, by path too, so the failure is not papered over by
            // an append through the log's file descriptor, opened before.
            disk.compact = true;
        }
        history
    }

    /// Appends the commit's changes to `journal.wal`, synced if it carries intents.
    fn append(&self, disk: &mut Disk, commit: &Commit) -> Result<(), JournalError> {
        let path = self.dir.join("journal.wal");
        let werr = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        let line = WalLine {
            seq: disk.seq,
            sync: commit.durable,
            mounts: commit
                .delta
                .mounts
                .iter()
                .map(|(k, m)| (k.clone(), m.as_deref().cloned()))
                .collect(),
            users: commit
                .delta
                .users
                .iter()
                .map(|(u, p)| (u.clone(), *p))
                .collect(),
        };
        let mut bytes = serde_json::to_vec(&line).map_err(|e| werr(std::io::Error::other(e)))?;
        bytes.push(b'\n');
        let f = disk
            .wal
            .as_mut()
            .ok_or_else(|| werr(std::io::Error::other("journal.wal is not open")))?;
        f.write_all(&bytes).map_err(werr)?;
        if commit.durable {
            f.sync_data().map_err(werr)?;
            self.syncs.fetch_add(1, Ordering::Relaxed);
        }
        disk.wal_bytes += bytes.len() as u64;
        Ok(())
    }

    /// Replaces `journal.json` with the whole state and empties `journal.wal`.
    fn compact(&self, disk: &mut Disk) -> Result<(), JournalError> {
        let path = self.dir.join("journal.json");
        let tmp = self.dir.join("journal.json.tmp");
        let werr = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        let bytes = serde_json::to_vec_pretty(&OnDiskRef {
            version: VERSION,
            node_id: &self.node_id,
            seq: disk.seq,
            mounts: disk.records.mounts.iter().map(|m| &*m.0).collect(),
            users: disk.records.users.iter().collect(),
        })
        .map_err(|e| werr(std::io::Error::other(e)))?;
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(FILE_MODE)
                .open(&tmp)
                .map_err(werr)?;
            // A temp file left by a crash keeps its old mode: set it.
            f.set_permissions(fs::Permissions::from_mode(FILE_MODE))
                .map_err(werr)?;
            f.write_all(&bytes).map_err(werr)?;
            f.sync_all().map_err(werr)?;
        }
        fs::rename(&tmp, &path).map_err(werr)?;
        // The log's lines are all in the snapshot now (their seq is not above its seq, so
        // a truncate that does not reach the disk leaves lines that load skips).
        let wal_path = self.dir.join("journal.wal");
        let wal = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(FILE_MODE)
            .open(&wal_path)
            .map_err(|source| JournalError::Write {
                path: wal_path.clone(),
                source,
            })?;
        wal.set_len(0).map_err(|source| JournalError::Write {
            path: wal_path.clone(),
            source,
        })?;
        // One directory sync makes the rename and a newly created log durable.
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(werr)?;
        self.syncs.fetch_add(2, Ordering::Relaxed);
        disk.wal = Some(wal);
        disk.wal_bytes = 0;
        disk.snapshot_bytes = bytes.len() as u64;
        disk.compact = false;
        Ok(())
    }

    /// Appends the history lines not yet in `journal.log` (`disk.unlogged`, after a
    /// `history-lost` line if some were dropped); they stay queued if the append fails,
    /// and what it wrote of them is cut off again.
    fn append_history(&self, disk: &mut Disk) -> Result<(), JournalError> {
        if disk.unlogged.is_empty() && disk.dropped == 0 {
            return Ok(());
        }
        let path = self.dir.join("journal.log");
        let werr = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        if fs::metadata(&path)
            .map(|m| m.len() > LOG_ROTATE_BYTES)
            .unwrap_or(false)
        {
            fs::rename(&path, self.dir.join("journal.log.1")).map_err(werr)?;
        }
        let mut text = String::new();
        if disk.dropped > 0 {
            let unix_ms = unix_ms();
            let line = serde_json::json!({
                "time": unix_ms / 1000, "unix_ms": unix_ms, "event": "history-lost",
                "detail": {"lines": disk.dropped,
                    "why": "the state directory could not be written for longer than the history kept in memory"},
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        disk.unlogged.iter().for_each(|l| text.push_str(l));
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(FILE_MODE)
            .open(&path)
            .map_err(werr)?;
        let before = f.metadata().map_err(werr)?.len();
        if let Err(e) = f.write_all(text.as_bytes()) {
            // A part written (ENOSPC after some blocks) is cut off: the lines are written
            // whole with the next write, never a torn line in between.
            let _ = f.set_len(before);
            return Err(werr(e));
        }
        disk.unlogged.clear();
        disk.dropped = 0;
        Ok(())
    }
}

/// Milliseconds since the Unix epoch (0 before it).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The `journal.log` lines of `events`, stamped now, each with its newline.
fn history_lines(events: &[Event]) -> Vec<String> {
    let unix_ms = unix_ms();
    events
        .iter()
        .map(|e| {
            let line = serde_json::json!({
                "time": unix_ms / 1000, "unix_ms": unix_ms, "event": e.kind.as_str(),
                "volume": e.volume.to_string(), "alloc_id": e.alloc_id, "detail": e.detail,
            });
            format!("{line}\n")
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests;
