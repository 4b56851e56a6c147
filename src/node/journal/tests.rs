//! The journal's records, files and history, on real files in temporary directories.
use super::*;

fn key() -> VolumeKey {
    VolumeKey {
        namespace: "default".into(),
        name: "data".into(),
    }
}

/// A mount record of `default/data` at `/x` (shared test fixture).
pub(crate) fn rec(state: MountState) -> MountRecord {
    MountRecord {
        volume: key(),
        volume_id: "id".into(),
        plugin_id: "bind".into(),
        state,
        target: "/x".into(),
        read_only: false,
        publish_context: Default::default(),
        since: 0,
        last_error: String::new(),
        claim_id: None,
        mount: None,
    }
}

fn open(dir: &Path, node: &str) -> Result<(Store, Journal), JournalError> {
    Store::open(dir, node)
}

/// Records allocation a1's publish intent for `default/data`.
fn publish_intent(j: &mut Journal) {
    j.set_mount(
        rec(MountState::Publishing),
        EventKind::PublishIntent,
        Some("a1"),
    );
}

/// Issue 10: a commit carries what changed since the last one, not every record (its
/// building on the agent's loop was O(records) per plan); the store writes the whole
/// state from its own copy, also after a failed write, and folded commits keep the
/// later state.
#[test]
fn a_commit_carries_only_what_changed_and_the_file_holds_everything() {
    let dir = tempfile::tempdir().unwrap();
    let at = |i: usize| {
        let mut m = rec(MountState::Published);
        m.volume.name = format!("v{i:03}").into();
        m.target = format!("/x/{i}").into();
        m
    };
    {
        let (store, mut j) = open(dir.path(), "node-1").unwrap();
        for i in 0..100 {
            j.set_mount(at(i), EventKind::PublishDone, None);
        }
        let c = j.take_commit().unwrap();
        assert_eq!(c.delta.mounts.len(), 100);
        store.write(&c).unwrap();
        let mut m = at(7);
        m.state = MountState::Unpublishing;
        j.set_mount(m, EventKind::UnpublishIntent, None);
        let c = j.take_commit().unwrap();
        assert_eq!(c.delta.mounts.len(), 1, "one record changed, one carried");
        store.write(&c).unwrap();
        // Folded: the later state wins; removed then written again is present.
        j.remove_mount(&at(8).volume, EventKind::UnpublishDone);
        let mut first = j.take_commit().unwrap();
        j.set_mount(at(8), EventKind::PublishDone, None);
        j.remove_mount(&at(9).volume, EventKind::UnpublishDone);
        first.absorb(j.take_commit().unwrap());
        store.write(&first).unwrap();
    }
    let (_, back) = open(dir.path(), "node-1").unwrap();
    assert_eq!(back.mounts().len(), 99, "100 written, v009 removed");
    assert_eq!(back.mounts()[&at(7).volume].state, MountState::Unpublishing);
    assert!(back.mounts().contains_key(&at(8).volume));
    assert!(!back.mounts().contains_key(&at(9).volume));
}

/// The recent outcomes per volume (what the node record shows): publish with the
/// allocation of its intent and its measured time, unpublish, fence; intents and
/// user records are not events; bounded per volume and in volumes.
#[test]
fn recent_outcomes_are_kept_per_volume_with_the_intents_allocation() {
    let mut j = Journal::new("n1");
    let r = rec(MountState::Publishing);
    let key = r.volume.clone();
    j.set_mount(r.clone(), EventKind::PublishIntent, Some("a1"));
    j.change_users(
        &[UserKey {
            alloc_id: "a1".into(),
            volume: key.clone(),
        }],
        &[],
    );
    let mut done = r.clone();
    done.state = MountState::Published;
    j.set_mount(done.clone(), EventKind::PublishDone, None);
    j.measured(&key, 132);
    j.note(EventKind::Fenced, &key, serde_json::Value::Null);
    let mut un = done;
    un.state = MountState::Unpublishing;
    j.set_mount(un, EventKind::UnpublishIntent, None);
    j.remove_mount(&key, EventKind::UnpublishDone);
    let got: Vec<(EventKind, Option<&str>, u64)> = j.recent()[&key]
        .iter()
        .map(|e| (e.kind, e.alloc_id.as_deref(), e.ms))
        .collect();
    assert_eq!(
        got,
        [
            (EventKind::PublishDone, Some("a1"), 132),
            (EventKind::Fenced, None, 0),
            (EventKind::UnpublishDone, None, 0),
        ]
    );
    for _ in 0..RECENT_PER_VOLUME + 3 {
        j.note(EventKind::Unfenced, &key, serde_json::Value::Null);
    }
    assert_eq!(j.recent()[&key].len(), RECENT_PER_VOLUME);
    for i in 0..RECENT_VOLUMES + 2 {
        let k = VolumeKey {
            namespace: "default".into(),
            name: format!("v{i}").into(),
        };
        j.note(EventKind::Fenced, &k, serde_json::Value::Null);
    }
    assert_eq!(j.recent().len(), RECENT_VOLUMES);
}

#[test]
fn survives_reopen_and_logs_history() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, mut j) = open(dir.path(), "node-1").unwrap();
        publish_intent(&mut j);
        store.write(&j.take_commit().unwrap()).unwrap();
        j.set_mount(
            rec(MountState::Published),
            EventKind::PublishDone,
            Some("a1"),
        );
        j.change_users(
            &[UserKey {
                alloc_id: "a1".into(),
                volume: key(),
            }],
            &[],
        );
        store.write(&j.take_commit().unwrap()).unwrap();
        assert!(j.take_commit().is_none(), "nothing changed since");
    }
    let (_, j) = open(dir.path(), "node-1").unwrap();
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
        open(dir.path(), "n"),
        Err(JournalError::Corrupt { .. })
    ));
    assert_eq!(
        fs::read(dir.path().join("journal.json")).unwrap(),
        b"{not json"
    );
    let dir = tempfile::tempdir().unwrap();
    open(dir.path(), "node-1").unwrap();
    assert!(matches!(
        open(dir.path(), "node-2"),
        Err(JournalError::Corrupt { .. })
    ));
}

/// A whole plan's intents cost one durable write (one line appended to the log and
/// one `fdatasync`), however many volumes it touches; outcomes and the history add
/// none of their own.
#[test]
fn a_plan_of_many_intents_is_one_durable_write() {
    let dir = tempfile::tempdir().unwrap();
    let (store, mut j) = open(dir.path(), "node-1").unwrap();
    let (syncs, commits) = (store.syncs(), store.commits());
    for i in 0..50 {
        let mut r = rec(MountState::Publishing);
        r.volume.name = format!("v{i}").into();
        j.set_mount(r, EventKind::PublishIntent, Some("a1"));
    }
    let users: Vec<UserKey> = (0..50)
        .map(|i| UserKey {
            alloc_id: format!("a{i}").into(),
            volume: key(),
        })
        .collect();
    j.change_users(&users, &[]);
    store.write(&j.take_commit().unwrap()).unwrap();
    assert_eq!(store.commits() - commits, 1);
    assert_eq!(store.syncs() - syncs, 1);
    // The outcomes of the whole plan: appended, not synced.
    for i in 0..50 {
        let mut r = rec(MountState::Published);
        r.volume.name = format!("v{i}").into();
        j.set_mount(r, EventKind::PublishDone, None);
    }
    j.remove_mount(&key(), EventKind::UnpublishDone);
    store.write(&j.take_commit().unwrap()).unwrap();
    assert_eq!(store.syncs() - syncs, 1, "outcomes are not synced");
    let (_, back) = open(dir.path(), "node-1").unwrap();
    assert_eq!(back.mounts().len(), 50);
    assert!(
        back.users().is_empty(),
        "removed with default/data's record"
    );
    let log = fs::read_to_string(dir.path().join("journal.log")).unwrap();
    // 50 intents, 50 users, 50 outcomes, 50 users removed with default/data.
    assert_eq!(log.lines().count(), 200);
}

/// Commits queued while one is written fold into one write of the latest state.
#[test]
fn queued_commits_fold_into_the_latest_state() {
    let dir = tempfile::tempdir().unwrap();
    let (store, mut j) = open(dir.path(), "node-1").unwrap();
    publish_intent(&mut j);
    let mut first = j.take_commit().unwrap();
    j.set_mount(rec(MountState::Published), EventKind::PublishDone, None);
    let second = j.take_commit().unwrap();
    let last = second.seq;
    assert!(last > first.seq);
    first.absorb(second);
    assert_eq!(first.seq, last);
    assert_eq!(first.events().len(), 2);
    store.write(&first).unwrap();
    let (_, j) = open(dir.path(), "node-1").unwrap();
    assert_eq!(j.mounts()[&key()].state, MountState::Published);
}

/// The state files hold the state, not its history: the log is compacted into the
/// snapshot, so churn does not grow them, and the state survives every compaction.
#[test]
fn the_state_files_do_not_grow_with_history() {
    let dir = tempfile::tempdir().unwrap();
    let (store, mut j) = open(dir.path(), "node-1").unwrap();
    let size = |name: &str| fs::metadata(dir.path().join(name)).unwrap().len();
    let mut keep = rec(MountState::Published);
    keep.volume.name = "kept".into();
    j.set_mount(keep.clone(), EventKind::PublishDone, None);
    let mut most = 0;
    for round in 0..3000 {
        // Outcomes only, so no syncs: the churn of a long life, quickly.
        j.set_mount(rec(MountState::Published), EventKind::PublishDone, None);
        store.write(&j.take_commit().unwrap()).unwrap();
        if round % 2 == 0 {
            j.remove_mount(&key(), EventKind::UnpublishDone);
            store.write(&j.take_commit().unwrap()).unwrap();
        }
        most = most.max(size("journal.json") + size("journal.wal"));
    }
    assert!(
        most < 2 * COMPACT_MIN_BYTES,
        "{most} bytes: the log was not compacted"
    );
    assert!(store.syncs() > 0 && store.syncs() < 20, "{}", store.syncs());
    let (_, back) = open(dir.path(), "node-1").unwrap();
    assert_eq!(back.mounts().len(), 2);
    assert_eq!(*back.mounts()[&keep.volume], {
        let mut k = keep.clone();
        k.since = back.mounts()[&keep.volume].since;
        k
    });
}

/// A crash while a line was appended leaves a torn last line: it is dropped (it held
/// changes that were never synced), the rest loads, and the next write compacts.
#[test]
fn a_torn_last_line_of_the_log_is_dropped_and_compacted_away() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, mut j) = open(dir.path(), "node-1").unwrap();
        publish_intent(&mut j);
        store.write(&j.take_commit().unwrap()).unwrap();
    }
    let wal = dir.path().join("journal.wal");
    let whole = fs::read(&wal).unwrap();
    assert!(!whole.is_empty(), "the intent is a line of the log");
    let mut torn = whole.clone();
    torn.extend_from_slice(br#"{"seq":3,"sync":false,"mounts":[[{"namespa"#);
    fs::write(&wal, &torn).unwrap();
    let (store, mut j) = open(dir.path(), "node-1").unwrap();
    assert_eq!(j.mounts()[&key()].state, MountState::Publishing);
    assert_eq!(fs::read(&wal).unwrap(), torn, "open changes nothing");
    j.set_mount(rec(MountState::Published), EventKind::PublishDone, None);
    store.write(&j.take_commit().unwrap()).unwrap();
    assert_eq!(fs::metadata(&wal).unwrap().len(), 0, "compacted");
    let (_, back) = open(dir.path(), "node-1").unwrap();
    assert_eq!(back.mounts()[&key()].state, MountState::Published);
}

/// An unreadable line before a synced one is not a torn tail (the sync made every byte
/// before it durable): the journal is refused and left as it is; so is a log whose
/// snapshot is gone, or one that skips a line.
#[test]
fn an_unreadable_line_before_a_synced_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, mut j) = open(dir.path(), "node-1").unwrap();
        publish_intent(&mut j);
        store.write(&j.take_commit().unwrap()).unwrap();
        let mut other = rec(MountState::Publishing);
        other.volume.name = "other".into();
        j.set_mount(other, EventKind::PublishIntent, None);
        store.write(&j.take_commit().unwrap()).unwrap();
    }
    let wal = dir.path().join("journal.wal");
    let text = fs::read_to_string(&wal).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    let bad = format!("{{not json\n{}\n", lines[1]);
    fs::write(&wal, &bad).unwrap();
    let err = open(dir.path(), "node-1").unwrap_err();
    assert!(matches!(err, JournalError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("synced line follows"), "{err}");
    assert_eq!(fs::read_to_string(&wal).unwrap(), bad, "left untouched");
    // A skipped line (seq 2 missing).
    fs::write(&wal, format!("{}\n", lines[1])).unwrap();
    let err = open(dir.path(), "node-1").unwrap_err();
    assert!(err.to_string().contains("seq"), "{err}");
    // The snapshot gone, the log not.
    fs::write(&wal, &text).unwrap();
    fs::remove_file(dir.path().join("journal.json")).unwrap();
    let err = open(dir.path(), "node-1").unwrap_err();
    assert!(err.to_string().contains("gone"), "{err}");
}

/// A version 1 journal (a state file and no log) loads, and is written as version 2.
#[test]
fn a_version_1_journal_loads() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = serde_json::json!({
        "version": 1, "node_id": "node-1",
        "mounts": [rec(MountState::Published)],
        "users": [UserKey { alloc_id: "a1".into(), volume: key() }],
    });
    fs::write(dir.path().join("journal.json"), v1.to_string()).unwrap();
    let (store, mut j) = open(dir.path(), "node-1").unwrap();
    assert_eq!(j.users().len(), 1);
    j.remove_mount(&key(), EventKind::UnpublishDone);
    store.write(&j.take_commit().unwrap()).unwrap();
    let (_, back) = open(dir.path(), "node-1").unwrap();
    assert!(back.mounts().is_empty() && back.users().is_empty());
    let stored = read_stored(dir.path()).unwrap();
    assert_eq!(stored.node_id, "node-1");
    assert!(stored.mounts.is_empty());
}

/// A journal of a newer format (a downgrade) is refused as such, before its records
/// are parsed (they need not parse as this format's), and left untouched.
#[test]
fn a_newer_format_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let newer = format!(
        r#"{{"version":{},"node_id":"node-1","mounts":{{"new":[]}}}}"#,
        VERSION + 1
    );
    fs::write(dir.path().join("journal.json"), &newer).unwrap();
    let err = open(dir.path(), "node-1").unwrap_err();
    assert!(
        matches!(err, JournalError::NewerFormat { found, .. } if found == VERSION + 1),
        "{err}"
    );
    assert!(err.to_string().contains("newer dhv-binder"), "{err}");
    assert_eq!(
        fs::read_to_string(dir.path().join("journal.json")).unwrap(),
        newer
    );
}

#[test]
fn the_state_dir_is_0700_and_the_journal_files_0600() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    // An existing directory and history file with loose modes are tightened too.
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(dir.join("journal.log"), b"").unwrap();
    fs::set_permissions(dir.join("journal.log"), fs::Permissions::from_mode(0o644)).unwrap();
    let (store, mut j) = open(&dir, "n").unwrap();
    j.set_mount(rec(MountState::Published), EventKind::PublishDone, None);
    store.write(&j.take_commit().unwrap()).unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "state directory");
    for name in ["journal.json", "journal.wal", "journal.log"] {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }
}

#[test]
fn no_user_record_outlives_its_mount_record() {
    let mut j = Journal::new("n");
    j.set_mount(rec(MountState::Published), EventKind::PublishDone, None);
    let other = VolumeKey {
        namespace: "default".into(),
        name: "other".into(),
    };
    let users = [
        UserKey {
            alloc_id: "a1".into(),
            volume: key(),
        },
        UserKey {
            alloc_id: "a2".into(),
            volume: other.clone(),
        },
    ];
    j.change_users(&users, &[]);
    j.remove_mount(&key(), EventKind::UnpublishDone);
    assert_eq!(
        j.users().iter().cloned().collect::<Vec<_>>(),
        vec![users[1].clone()],
        "the unpublished volume's user record goes with its mount record"
    );
}

/// A publish context is written and read as the plugin's JSON: `null` (none) keeps no box,
/// and a record without the field reads as none.
#[test]
fn a_publish_context_is_kept_as_the_plugins_json_and_null_keeps_nothing() {
    let none = PublishContext::from(serde_json::Value::Null);
    assert_eq!(none, PublishContext::default());
    assert_eq!(serde_json::to_string(&none).unwrap(), "null");
    let ctx = serde_json::json!({"dev_path": "/dev/loop3", "n": 1});
    let kept = PublishContext::from(ctx.clone());
    assert_eq!(kept.value(), &ctx);
    let mut r = rec(MountState::Published);
    r.publish_context = kept;
    let line = serde_json::to_value(&r).unwrap();
    assert_eq!(line["publish_context"], ctx, "written as the plugin's JSON");
    let back: MountRecord = serde_json::from_value(line.clone()).unwrap();
    assert_eq!(back, r);
    let mut without = line;
    without.as_object_mut().unwrap().remove("publish_context");
    let read: MountRecord = serde_json::from_value(without).unwrap();
    assert_eq!(read.publish_context, PublishContext::default());
    assert_eq!(read.publish_context.value(), &serde_json::Value::Null);
}
