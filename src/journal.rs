//! The durable local journal: which volumes this node has published where, and which
//! allocations use them. Written ahead of every plugin call (intent) and after it (outcome).
//!
//! Layout in the state directory:
//! - `journal.json`: the current records, replaced atomically (temp file, fsync, rename,
//!   fsync of the directory), versioned;
//! - `journal.log`: an append-only history, one JSON object per line, for operators and
//!   tests (`{"time":<unix s>,"unix_ms":<unix ms>,"event":"publish-done","volume":"ns/name",..}`).
//!
//! Secrets never enter either file.

use crate::volume::VolumeKey;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

const VERSION: u32 = 1;
const LOG_ROTATE_BYTES: u64 = 16 << 20;

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
    pub publish_context: serde_json::Value,
    /// Unix seconds of the last state change.
    pub since: u64,
    /// Last plugin error, if the last attempt failed.
    #[serde(default)]
    pub last_error: String,
    /// The lock ID of this node's claim (single-node access modes), kept so that a restarted
    /// agent can renew it, or learn that it lost it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_id: Option<String>,
}

/// One allocation's use of one published volume.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UserKey {
    pub alloc_id: String,
    pub volume: VolumeKey,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct OnDisk {
    version: u32,
    node_id: String,
    mounts: Vec<MountRecord>,
    users: Vec<UserKey>,
}

/// The journal, loaded in memory and written through on every change.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    node_id: String,
    mounts: BTreeMap<VolumeKey, MountRecord>,
    users: BTreeSet<UserKey>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Journal {
    /// Opens (or creates) the journal in `dir`. A corrupt file is an error, never discarded.
    pub fn open(dir: &Path, node_id: &str) -> Result<Self, JournalError> {
        fs::create_dir_all(dir).map_err(|source| JournalError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join("journal.json");
        let mut j = Self {
            dir: dir.to_path_buf(),
            node_id: node_id.to_string(),
            mounts: BTreeMap::new(),
            users: BTreeSet::new(),
        };
        match fs::read(&path) {
            Ok(bytes) => {
                let disk: OnDisk =
                    serde_json::from_slice(&bytes).map_err(|e| JournalError::Corrupt {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                if disk.version != VERSION {
                    return Err(JournalError::Corrupt {
                        path,
                        reason: format!("version {} (this build reads {VERSION})", disk.version),
                    });
                }
                if !disk.node_id.is_empty() && disk.node_id != node_id {
                    return Err(JournalError::Corrupt {
                        path,
                        reason: format!(
                            "written for node {} but this agent runs on node {node_id}",
                            disk.node_id
                        ),
                    });
                }
                j.mounts = disk
                    .mounts
                    .into_iter()
                    .map(|m| (m.volume.clone(), m))
                    .collect();
                j.users = disk.users.into_iter().collect();
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => j.persist()?,
            Err(source) => return Err(JournalError::Read { path, source }),
        }
        Ok(j)
    }

    /// All mount records.
    pub fn mounts(&self) -> &BTreeMap<VolumeKey, MountRecord> {
        &self.mounts
    }

    /// All (allocation, volume) users.
    pub fn users(&self) -> &BTreeSet<UserKey> {
        &self.users
    }

    /// Records a mount state change (intent or outcome) and appends `event` to the history.
    pub fn set_mount(
        &mut self,
        mut rec: MountRecord,
        event: &str,
        alloc: Option<&str>,
    ) -> Result<(), JournalError> {
        rec.since = now_secs();
        let detail = serde_json::json!({
            "target": rec.target, "read_only": rec.read_only, "error": rec.last_error,
        });
        let key = rec.volume.clone();
        let prev = self.mounts.insert(key.clone(), rec);
        if let Err(e) = self.persist() {
            match prev {
                Some(p) => self.mounts.insert(key, p),
                None => self.mounts.remove(&key),
            };
            return Err(e);
        }
        self.log(event, &key, alloc, detail)
    }

    /// Removes a volume's mount record (after a successful unpublish).
    pub fn remove_mount(&mut self, key: &VolumeKey, event: &str) -> Result<(), JournalError> {
        if let Some(prev) = self.mounts.remove(key) {
            if let Err(e) = self.persist() {
                self.mounts.insert(key.clone(), prev);
                return Err(e);
            }
            self.log(event, key, None, serde_json::Value::Null)?;
        }
        Ok(())
    }

    /// Adds and removes user records in one durable write (one fsync for a whole plan,
    /// however many allocations stop at once).
    pub fn change_users(
        &mut self,
        add: &[UserKey],
        remove: &[UserKey],
    ) -> Result<(), JournalError> {
        let before = self.users.clone();
        let added: Vec<&UserKey> = add
            .iter()
            .filter(|u| self.users.insert((*u).clone()))
            .collect();
        let removed: Vec<&UserKey> = remove.iter().filter(|u| self.users.remove(*u)).collect();
        if added.is_empty() && removed.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.persist() {
            self.users = before;
            return Err(e);
        }
        let mut lines = Vec::new();
        for (event, list) in [("user-added", &added), ("user-removed", &removed)] {
            for u in list.iter() {
                lines.push((
                    event,
                    &u.volume,
                    Some(u.alloc_id.as_str()),
                    serde_json::Value::Null,
                ));
            }
        }
        self.log_many(&lines)
    }

    /// Adds an allocation as a user of a published volume.
    pub fn add_user(&mut self, user: UserKey) -> Result<(), JournalError> {
        if self.users.insert(user.clone()) {
            if let Err(e) = self.persist() {
                self.users.remove(&user);
                return Err(e);
            }
            self.log(
                "user-added",
                &user.volume,
                Some(&user.alloc_id),
                serde_json::Value::Null,
            )?;
        }
        Ok(())
    }

    /// Removes an allocation's use of a volume (the allocation is finished).
    pub fn remove_user(&mut self, user: &UserKey) -> Result<(), JournalError> {
        if self.users.remove(user) {
            if let Err(e) = self.persist() {
                self.users.insert(user.clone());
                return Err(e);
            }
            self.log(
                "user-removed",
                &user.volume,
                Some(&user.alloc_id),
                serde_json::Value::Null,
            )?;
        }
        Ok(())
    }

    fn persist(&self) -> Result<(), JournalError> {
        let path = self.dir.join("journal.json");
        let tmp = self.dir.join("journal.json.tmp");
        let werr = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        let disk = OnDisk {
            version: VERSION,
            node_id: self.node_id.clone(),
            mounts: self.mounts.values().cloned().collect(),
            users: self.users.iter().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&disk).map_err(|e| werr(std::io::Error::other(e)))?;
        {
            let mut f = File::create(&tmp).map_err(werr)?;
            f.write_all(&bytes).map_err(werr)?;
            f.sync_all().map_err(werr)?;
        }
        fs::rename(&tmp, &path).map_err(werr)?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(werr)?;
        Ok(())
    }

    fn log(
        &self,
        event: &str,
        volume: &VolumeKey,
        alloc: Option<&str>,
        detail: serde_json::Value,
    ) -> Result<(), JournalError> {
        self.log_many(&[(event, volume, alloc, detail)])
    }

    /// Appends history lines with one write and one fsync.
    #[allow(clippy::type_complexity)]
    fn log_many(
        &self,
        entries: &[(&str, &VolumeKey, Option<&str>, serde_json::Value)],
    ) -> Result<(), JournalError> {
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
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut text = String::new();
        for (event, volume, alloc, detail) in entries {
            let line = serde_json::json!({
                "time": now_secs(), "unix_ms": unix_ms, "event": event, "volume": volume.to_string(),
                "alloc_id": alloc, "detail": detail,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(werr)?;
        f.write_all(text.as_bytes()).map_err(werr)?;
        f.sync_data().map_err(werr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: "data".into(),
        }
    }

    fn rec(state: MountState) -> MountRecord {
        MountRecord {
            volume: key(),
            volume_id: "id".into(),
            plugin_id: "bind".into(),
            state,
            target: "/x".into(),
            read_only: false,
            publish_context: serde_json::Value::Null,
            since: 0,
            last_error: String::new(),
            claim_id: None,
        }
    }

    #[test]
    fn survives_reopen_and_logs_history() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut j = Journal::open(dir.path(), "node-1").unwrap();
            j.set_mount(rec(MountState::Publishing), "publish-intent", Some("a1"))
                .unwrap();
            j.set_mount(rec(MountState::Published), "publish-done", Some("a1"))
                .unwrap();
            j.add_user(UserKey {
                alloc_id: "a1".into(),
                volume: key(),
            })
            .unwrap();
        }
        let j = Journal::open(dir.path(), "node-1").unwrap();
        assert_eq!(j.mounts()[&key()].state, MountState::Published);
        assert_eq!(j.users().len(), 1);
        let log = fs::read_to_string(dir.path().join("journal.log")).unwrap();
        assert_eq!(log.lines().count(), 3);
        assert!(log.contains("\"publish-done\""));
    }

    #[test]
    fn corrupt_or_foreign_journal_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("journal.json"), b"{not json").unwrap();
        assert!(matches!(
            Journal::open(dir.path(), "n"),
            Err(JournalError::Corrupt { .. })
        ));
        assert_eq!(
            fs::read(dir.path().join("journal.json")).unwrap(),
            b"{not json"
        );
        let dir = tempfile::tempdir().unwrap();
        Journal::open(dir.path(), "node-1").unwrap();
        assert!(matches!(
            Journal::open(dir.path(), "node-2"),
            Err(JournalError::Corrupt { .. })
        ));
    }
}
