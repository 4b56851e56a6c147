//! The core's decisions, driven with plain `Instant`s: no tokio, no root, no I/O.
use super::*;
use crate::agent::effect::publishes;
use crate::agent::executor::{StepError, WorkerError};
use crate::agent::reconcile::tests::{alloc, key, volume};
use crate::api::PublishRequest;
use crate::cluster::claims::ClaimError;
use crate::node::journal::Journal;
use crate::node::mounts::MountTable;

mod claims;
mod offers;
mod planning;
mod ungated;

const NODE: &str = "node-1";

fn settings() -> Settings {
    Settings {
        node: NodeEnv {
            node_id: NODE.into(),
            node_pool: "default".into(),
            volumes_dir: "/v".into(),
            plugin_dir: "/p".into(),
        },
        mount_root: "/m".into(),
        plugin_rescan: Duration::from_secs(60),
        claims: ClaimSettings {
            ttl: Duration::from_secs(15),
            lock_delay: Duration::from_secs(15),
            fence_margin: Duration::from_secs(15),
        },
        health_interval: Duration::from_secs(10),
        heartbeat_interval_max: Duration::from_secs(20),
        seed: 1,
        max_volumes: Default::default(),
    }
}

fn target(name: &str) -> PathBuf {
    PathBuf::from(format!("/m/default/{name}"))
}

/// What a publish of `name` established, as `MountTable::from_points` shows it.
fn mounted_at(name: &str) -> crate::agent::executor::PublishedMount {
    crate::agent::executor::PublishedMount {
        context: serde_json::Value::Null,
        mount: crate::node::mounts::MountIdentity::of_point(&target(name)),
    }
}

struct H {
    core: Core,
    t: Instant,
    /// Every effect of the set-up.
    setup: Vec<Effect>,
}

impl H {
    /// A core that knows its plugin (`bind`), the volumes and the allocations.
    fn new(volumes: &[(&str, &str)], allocs: Vec<crate::nomad::types::Allocation>) -> Self {
        Self::with_journal(Journal::new(NODE), volumes, allocs)
    }

    /// [`H::new`] with the journal a [`crate::node::journal::Store`] read.
    fn with_journal(
        journal: Journal,
        volumes: &[(&str, &str)],
        allocs: Vec<crate::nomad::types::Allocation>,
    ) -> Self {
        let t = Instant::now();
        let mut h = H {
            core: Core::new(settings(), journal, t),
            t,
            setup: Vec::new(),
        };
        h.feed(Input::MountTable(MountTable::default()));
        let fp = Fingerprint {
            version: "1".into(),
            deferred_bind: true,
            capabilities: Vec::new(),
            ..Default::default()
        };
        h.feed(Input::Done(Completion::Plugins(BTreeMap::from([(
            "bind".to_string(),
            Ok(fp),
        )]))));
        let e = h.feed(Input::Catalogue(
            volumes
                .iter()
                .map(|(n, m)| (key(n), std::sync::Arc::new(volume(n, m))))
                .collect(),
        ));
        h.setup.extend(e);
        // The placeholders are listed once the records are known (the namespaces served).
        let e = h.feed(Input::Tick);
        assert!(
            e.iter()
                .any(|x| matches!(x, Effect::ListPlaceholders { .. })),
            "{e:?}"
        );
        h.setup.extend(e);
        let e = h.feed(Input::Done(Completion::PlaceholdersListed(Ok(
            BTreeMap::new(),
        ))));
        h.setup.extend(e);
        let e = h.feed(Input::Watch(WatchEvent::Relisted { allocs, index: 1 }));
        h.setup.extend(e);
        h
    }

    fn feed(&mut self, i: Input) -> Vec<Effect> {
        self.core.handle(i, self.t)
    }

    fn at(&mut self, after: Duration, i: Input) -> Vec<Effect> {
        self.t += after;
        self.feed(i)
    }

    fn api_publish(&mut self, reply: u64, alloc_id: &str, wait: Duration) -> Vec<Effect> {
        self.feed(Input::Api {
            reply: ReplyId(reply),
            call: ApiCall::Publish(PublishRequest {
                alloc_id: alloc_id.into(),
                namespace: "default".into(),
                wait,
                progress: None,
            }),
        })
    }

    /// Completes a publish of `name` with its mount now in the table.
    fn published(&mut self, name: &str) -> Vec<Effect> {
        self.feed(Input::MountTable(MountTable::from_points([target(name)])));
        self.feed(Input::Done(Completion::Published {
            volume: key(name),
            result: Ok(mounted_at(name)),
            elapsed: Duration::from_millis(3),
        }))
    }

    fn committed(&mut self, e: &[Effect]) -> Vec<Effect> {
        let seq = commits(e).last().map(|(s, _)| *s).expect("a commit");
        self.feed(Input::Committed {
            seq,
            result: Ok(()),
        })
    }
}

/// The commits of `e`: (seq, the effects waiting on it).
fn commits(e: &[Effect]) -> Vec<(u64, &Vec<Effect>)> {
    e.iter()
        .filter_map(|e| match e {
            Effect::Commit { commit, then } => Some((commit.seq, then)),
            _ => None,
        })
        .collect()
}

fn unpublishes(e: &[Effect]) -> usize {
    e.iter()
        .map(|e| match e {
            Effect::Unpublish { .. } => 1,
            Effect::Commit { then, .. } => unpublishes(then),
            _ => 0,
        })
        .sum()
}

fn replies(e: &[Effect]) -> Vec<(u64, &Result<PublishReply, ApiError>)> {
    e.iter()
        .filter_map(|e| match e {
            Effect::Reply {
                to,
                answer: Answer::Publish(r),
            } => Some((to.0, r)),
            _ => None,
        })
        .collect()
}

const A1: &str = "a1";

#[test]
fn a_publish_starts_only_after_its_intent_is_committed() {
    let t = Instant::now();
    let mut core = Core::new(settings(), Journal::new(NODE), t);
    let mut all = Vec::new();
    all.extend(core.handle(Input::MountTable(MountTable::default()), t));
    let fp = Fingerprint {
        version: "1".into(),
        deferred_bind: true,
        capabilities: Vec::new(),
        ..Default::default()
    };
    all.extend(core.handle(
        Input::Done(Completion::Plugins(BTreeMap::from([(
            "bind".into(),
            Ok(fp),
        )]))),
        t,
    ));
    all.extend(core.handle(
        Input::Catalogue(crate::cluster::catalog::shared(BTreeMap::from([(
            key("d"),
            volume("d", "multi-node-multi-writer"),
        )]))),
        t,
    ));
    let e = core.handle(
        Input::Watch(WatchEvent::Relisted {
            allocs: vec![alloc(A1, &["d"], "pending", "run")],
            index: 1,
        }),
        t,
    );
    assert_eq!(publishes(&all), 0);
    let c = commits(&e);
    assert_eq!(c.len(), 1, "{e:?}");
    assert_eq!(publishes(c[0].1), 1, "the publish waits on the commit");
    assert!(
        !e.iter().any(|x| matches!(x, Effect::Publish { .. })),
        "no publish outside the commit"
    );
    assert_eq!(
        core.journal().mounts()[&key("d")].state,
        MountState::Publishing
    );
}

#[test]
fn a_burst_of_allocations_is_one_commit_with_every_publish() {
    let names: Vec<String> = (0..50).map(|i| format!("v{i}")).collect();
    let vols: Vec<(&str, &str)> = names
        .iter()
        .map(|n| (n.as_str(), "multi-node-multi-writer"))
        .collect();
    let t = Instant::now();
    let mut h = H {
        core: Core::new(settings(), Journal::new(NODE), t),
        t,
        setup: Vec::new(),
    };
    h.feed(Input::MountTable(MountTable::default()));
    h.feed(Input::Done(Completion::Plugins(BTreeMap::from([(
        "bind".to_string(),
        Ok(Fingerprint {
            version: "1".into(),
            deferred_bind: true,
            capabilities: Vec::new(),
            ..Default::default()
        }),
    )]))));
    h.feed(Input::Catalogue(
        vols.iter()
            .map(|(n, m)| (key(n), std::sync::Arc::new(volume(n, m))))
            .collect(),
    ));
    let allocs = names
        .iter()
        .enumerate()
        .map(|(i, n)| alloc(&format!("a{i}"), &[n.as_str()], "pending", "run"))
        .collect();
    let e = h.feed(Input::Watch(WatchEvent::Relisted { allocs, index: 1 }));
    let c = commits(&e);
    assert_eq!(c.len(), 1);
    assert_eq!(publishes(c[0].1), 50);
}

#[test]
fn a_caller_is_answered_once_its_user_record_is_durable() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    assert!(replies(&h.api_publish(7, A1, Duration::from_secs(30))).is_empty());
    let e = h.published("d");
    assert!(
        replies(&e).is_empty(),
        "held until the user record is on disk"
    );
    assert_eq!(
        commits(&e).len(),
        1,
        "publish-done and the user record, one commit"
    );
    let e = h.committed(&e);
    let r = replies(&e);
    assert_eq!(r.len(), 1);
    let (to, Ok(reply)) = r[0] else {
        panic!("{r:?}")
    };
    assert_eq!(to, 7);
    assert_eq!(reply.volumes[0].path, target("d").display().to_string());
}

#[test]
fn a_failed_commit_starts_nothing_and_answers_no_success() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    h.api_publish(7, A1, Duration::from_secs(30));
    let e = h.published("d");
    let seq = commits(&e)[0].0;
    let err = JournalError::Write {
        path: "/s/journal.json".into(),
        source: std::io::Error::other("disk full"),
    };
    let e = h.feed(Input::Committed {
        seq,
        result: Err(err),
    });
    let r = replies(&e);
    assert!(matches!(r[..], [(7, Err(ApiError::Journal(_)))]), "{r:?}");
    assert!(commits(&e).is_empty(), "written again only after a pause");
    let e = h.at(crate::agent::journal_trouble::RETRY_AFTER, Input::Tick);
    assert_eq!(commits(&e).len(), 1, "the state is written again");
}

fn disk_full() -> JournalError {
    JournalError::Write {
        path: "/s/journal.wal".into(),
        source: std::io::Error::from_raw_os_error(28),
    }
}

/// A journal that cannot be written is a paced, reported condition: no write on every
/// pass, no publish started, new publish callers refused at once with the reason, the
/// status says so; the first write that succeeds starts the waiting publish.
#[test]
fn a_full_state_disk_pauses_new_work_and_resumes_by_itself() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    let seq = commits(&h.setup)[0].0;
    let e = h.feed(Input::Committed {
        seq,
        result: Err(disk_full()),
    });
    assert!(commits(&e).is_empty() && publishes(&e) == 0, "{e:?}");
    assert_eq!(h.core.status()["journal"]["failing"], true);
    let why = h.core.status()["waiting"].to_string();
    assert!(why.contains("state journal cannot be written"), "{why}");
    let errors = h.core.status()["errors"].to_string();
    assert!(
        errors.contains("state journal cannot be written"),
        "{errors}"
    );
    // Passes in between write nothing and start nothing.
    for _ in 0..50 {
        let e = h.at(Duration::from_millis(10), Input::Tick);
        assert!(commits(&e).is_empty() && publishes(&e) == 0, "{e:?}");
    }
    let e = h.api_publish(9, A1, Duration::from_secs(30));
    let r = replies(&e);
    assert!(
        matches!(&r[..], [(9, Err(ApiError::Journal(m)))] if m.contains("free space")),
        "{r:?}"
    );
    // Tried again about once a second; still failing.
    assert!(h
        .core
        .next_wakeup()
        .is_some_and(|w| w <= h.t + Duration::from_secs(1)));
    let e = h.at(Duration::from_secs(1), Input::Tick);
    let c = commits(&e);
    assert_eq!(c.len(), 1, "{e:?}");
    assert_eq!(publishes(c[0].1), 0, "no publish rides on a retry write");
    let e = h.feed(Input::Committed {
        seq: c[0].0,
        result: Err(disk_full()),
    });
    assert!(commits(&e).is_empty());
    assert_eq!(h.core.status()["journal"]["failed_writes"], 2);
    // Space returns: the next write succeeds and the publish starts.
    let e = h.at(Duration::from_secs(1), Input::Tick);
    let seq = commits(&e)[0].0;
    let e = h.feed(Input::Committed {
        seq,
        result: Ok(()),
    });
    assert_eq!(h.core.status()["journal"]["failing"], false);
    // The errors the trouble gave end with it.
    assert_eq!(h.core.status()["errors"], serde_json::json!({}));
    let c = commits(&e);
    assert_eq!(c.len(), 1, "{e:?}");
    assert_eq!(publishes(c[0].1), 1, "the waiting publish starts");
    let e = h.api_publish(10, A1, Duration::from_secs(30));
    assert!(replies(&e).is_empty(), "a new caller waits for the publish");
}

/// Every mount stacked at a test's directory, detached on drop (even on failure).
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        while crate::node::mounts::is_mount_point(&self.0) {
            if nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
    }
}

/// Issue 36, item 5: the state directory turns read-only under a running journal (EROFS,
/// for real: a superblock `remount,ro` is refused while the journal's log is open for
/// writing, so the directory is bound onto itself and that mount remounted read-only; every
/// write by path fails with EROFS). It is the same condition as a full disk: reported, no
/// publish started, tried again about once a second; after `remount,bind,rw` the next
/// write succeeds and the waiting publish starts. The journal read back afterwards holds
/// the publish's intent: never truncated, never undecodable.
#[test]
fn a_read_only_state_directory_is_reported_and_recovered_after_remount_rw() {
    use crate::node::journal::Store;
    use nix::mount::{mount, MsFlags};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let (store, journal) = Store::open(&state, NODE).unwrap();
    let mut h = H::with_journal(
        journal,
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    let remount = |flags: MsFlags| {
        mount(None::<&str>, &state, None::<&str>, flags, None::<&str>)
            .unwrap_or_else(|e| panic!("remount {}: {e} (the test needs root)", state.display()))
    };
    mount(
        Some(&state),
        &state,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap_or_else(|e| panic!("bind {}: {e} (the test needs root)", state.display()));
    let _unmount = Unmount(state.clone());
    remount(MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY);

    // Each commit the core asks for is written for real.
    let write = |e: &[Effect]| -> Vec<(u64, Result<(), crate::node::journal::JournalError>)> {
        e.iter()
            .filter_map(|e| match e {
                Effect::Commit { commit, .. } => Some((commit.seq, store.write(commit))),
                _ => None,
            })
            .collect()
    };
    let mut w = write(&h.setup);
    assert_eq!(w.len(), 1, "{:?}", h.setup);
    let (seq, result) = w.remove(0);
    let err = result
        .as_ref()
        .expect_err("a write to a read-only directory");
    assert!(err.to_string().contains("Read-only file system"), "{err}");
    let e = h.feed(Input::Committed { seq, result });
    assert!(commits(&e).is_empty() && publishes(&e) == 0, "{e:?}");
    let st = h.core.status();
    assert_eq!(st["journal"]["failing"], true, "{st}");
    assert!(
        st["journal"]["error"]
            .as_str()
            .is_some_and(|m| m.contains("Read-only file system")),
        "{st}"
    );
    assert!(st["waiting"]
        .to_string()
        .contains("state journal cannot be written"));
    // Tried again about once a second, whole; still read-only.
    let e = h.at(Duration::from_secs(1), Input::Tick);
    let mut w = write(&e);
    assert_eq!(w.len(), 1, "{e:?}");
    let (seq, result) = w.remove(0);
    assert!(result.is_err());
    h.feed(Input::Committed { seq, result });
    assert_eq!(h.core.status()["journal"]["failed_writes"], 2);

    // Writable again: the next write succeeds and the waiting publish starts.
    remount(MsFlags::MS_REMOUNT | MsFlags::MS_BIND);
    let e = h.at(Duration::from_secs(1), Input::Tick);
    let mut w = write(&e);
    assert_eq!(w.len(), 1, "{e:?}");
    let (seq, result) = w.remove(0);
    result.as_ref().expect("a write after remount rw");
    let e = h.feed(Input::Committed { seq, result });
    assert_eq!(h.core.status()["journal"]["failing"], false);
    let c = commits(&e);
    assert_eq!(c.len(), 1, "{e:?}");
    assert_eq!(publishes(c[0].1), 1, "the waiting publish starts");
    for (_, r) in write(&e) {
        r.unwrap();
    }
    drop(store);

    // The journal decodes, with the publish's intent.
    let (_, back) = Store::open(&state, NODE).expect("the journal decodes");
    let m = back.mounts().get(&key("d")).expect("the intent is kept");
    assert_eq!(m.state, MountState::Publishing);
}

#[test]
fn publish_timed_out_when_the_deadline_passes_first() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    h.api_publish(7, A1, Duration::from_secs(2));
    assert_eq!(h.core.next_wakeup(), Some(h.t + Duration::from_secs(2)));
    assert!(replies(&h.at(Duration::from_secs(1), Input::Tick)).is_empty());
    let e = h.at(Duration::from_secs(1), Input::Tick);
    assert!(
        matches!(
            replies(&e)[..],
            [(7, Err(ApiError::NotPublishedInTime { .. }))]
        ),
        "{e:?}"
    );
}

#[test]
fn a_caller_for_an_allocation_not_seen_yet_times_out_after_a_fetch() {
    let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
    let e = h.api_publish(7, A1, Duration::from_secs(1));
    assert!(
        matches!(&e[..], [Effect::FetchAlloc { alloc_id }] if alloc_id == A1),
        "{e:?}"
    );
    let e = h.at(Duration::from_secs(1), Input::Tick);
    assert!(matches!(
        replies(&e)[..],
        [(7, Err(ApiError::AllocationNotSeen { .. }))]
    ));
}

#[test]
fn an_allocation_nomad_does_not_know_is_not_found() {
    let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
    h.api_publish(7, A1, Duration::from_secs(30));
    let e = h.feed(Input::Done(Completion::AllocFetched {
        alloc_id: A1.into(),
        result: Ok(None),
    }));
    assert!(matches!(
        replies(&e)[..],
        [(7, Err(ApiError::UnknownAllocation { .. }))]
    ));
}

#[test]
fn a_caller_that_went_away_is_forgotten() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    h.api_publish(7, A1, Duration::from_secs(30));
    h.feed(Input::CallerGone(ReplyId(7)));
    let e = h.at(Duration::from_secs(31), Input::Tick);
    assert!(replies(&e).is_empty());
}

#[test]
fn a_failed_publish_fails_its_caller_and_is_retried_after_its_backoff() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    h.api_publish(7, A1, Duration::from_secs(30));
    let err = StepError::NotMounted {
        plugin: "bind".into(),
        target: target("d"),
    };
    let e = h.feed(Input::Done(Completion::Published {
        volume: key("d"),
        result: Err(err),
        elapsed: Duration::from_millis(1),
    }));
    assert!(
        matches!(replies(&e)[..], [(7, Err(ApiError::PublishFailed { .. }))]),
        "{e:?}"
    );
    assert_eq!(publishes(&e), 0, "not again at once");
    let wake = h.core.next_wakeup().unwrap();
    assert!(
        wake <= h.t + Duration::from_millis(1200),
        "the retry is a wake-up"
    );
    let e = h.at(Duration::from_millis(1200), Input::Tick);
    assert_eq!(publishes(&e), 1);
}

#[test]
fn a_stopped_allocation_is_refused_and_its_volume_unpublished() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    let e = h.published("d");
    h.committed(&e);
    let mut a = alloc(A1, &["d"], "complete", "stop");
    a.modify_index = 5;
    let e = h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
    assert_eq!(unpublishes(&e), 1, "{e:?}");
    let e = h.api_publish(8, A1, Duration::from_secs(30));
    assert!(matches!(
        replies(&e)[..],
        [(8, Err(ApiError::AllocationStopped { .. }))]
    ));
}

#[test]
fn placeholders_follow_the_ready_volumes_this_node_serves() {
    let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
    let e = std::mem::take(&mut h.setup);
    let regs: Vec<_> = e
        .iter()
        .filter(|x| matches!(x, Effect::RegisterPlaceholder { target: t, .. } if *t == target("d")))
        .collect();
    assert_eq!(regs.len(), 1, "{e:?}");
    assert!(
        !h.feed(Input::Tick)
            .iter()
            .any(|x| matches!(x, Effect::RegisterPlaceholder { .. })),
        "once in flight"
    );
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("d"),
        result: Ok(Some("hv-1".into())),
    }));
    let e = h.feed(Input::Catalogue(BTreeMap::new()));
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::DeregisterPlaceholder { id, .. } if id == "hv-1")));
}

#[test]
fn pending_volumes_are_created_and_a_mounted_one_is_not_deleted() {
    let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
    let mut rec = volume("d", "multi-node-multi-writer");
    rec.state = VolumeState::Pending;
    let e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("d"), rec.clone())]),
    )));
    assert_eq!(
        e.iter().filter(|x| matches!(x, Effect::Create(_))).count(),
        1
    );
    h.feed(Input::Done(Completion::Worker {
        volume: key("d"),
        result: Err(WorkerError::TakenByOther),
    }));
    let e = h.feed(Input::Tick);
    assert!(
        !e.iter().any(|x| matches!(x, Effect::Create(_))),
        "backs off"
    );
    // A volume being deleted while a placeholder still points at it waits.
    rec.state = VolumeState::Deleting;
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("d"),
        result: Ok(Some("hv-1".into())),
    }));
    let e = h.at(
        Duration::from_secs(5),
        Input::Catalogue(crate::cluster::catalog::shared(BTreeMap::from([(
            key("d"),
            rec,
        )]))),
    );
    assert!(!e.iter().any(|x| matches!(x, Effect::Delete(_))), "{e:?}");
}

#[test]
fn plugins_are_fingerprinted_on_change_and_once_per_rescan() {
    let mut h = H::new(&[], vec![]);
    // The fingerprints asked for: `changed_only` of each.
    let fp = |e: &[Effect]| -> Vec<bool> {
        e.iter()
            .filter_map(|x| match x {
                Effect::Fingerprint { changed_only } => Some(*changed_only),
                _ => None,
            })
            .collect()
    };
    let done = |h: &mut H| h.feed(Input::Done(Completion::Plugins(BTreeMap::new())));
    // The harness's first tick (which lists the placeholders) fingerprints every plugin.
    assert_eq!(fp(&h.setup), [false], "every plugin at start");
    assert_eq!(fp(&h.feed(Input::Tick)), [] as [bool; 0], "one in flight");
    done(&mut h);
    assert_eq!(
        fp(&h.at(Duration::from_secs(1), Input::Tick)),
        [] as [bool; 0]
    );
    assert_eq!(
        fp(&h.feed(Input::PluginsChanged)),
        [false],
        "every plugin on a change"
    );
    done(&mut h);
    // The periodic rescan runs only the plugins whose file changed (no exec while idle).
    assert_eq!(fp(&h.at(Duration::from_secs(61), Input::Tick)), [true]);
    // A change seen while a rescan is in flight runs every plugin after it.
    assert_eq!(
        fp(&h.feed(Input::PluginsChanged)),
        [] as [bool; 0],
        "one in flight"
    );
    done(&mut h);
    assert_eq!(fp(&h.feed(Input::Tick)), [false]);
    // A directory that could not be read: the next fingerprint runs every plugin.
    h.feed(Input::Done(Completion::PluginsUnreadable {
        dir: "/plugins".into(),
        error: std::io::Error::other("EIO"),
    }));
    assert_eq!(fp(&h.at(Duration::from_secs(61), Input::Tick)), [false]);
    done(&mut h);
    assert_eq!(fp(&h.at(Duration::from_secs(61), Input::Tick)), [true]);
}

#[test]
fn the_mount_table_is_read_on_the_tick_not_per_message() {
    let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
    let reads = |e: &[Effect]| {
        e.iter()
            .filter(|x| matches!(x, Effect::ReadMountTable))
            .count()
    };
    let e = h.feed(Input::Watch(WatchEvent::Relisted {
        allocs: vec![alloc(A1, &["d"], "pending", "run")],
        index: 2,
    }));
    assert_eq!(reads(&e), 0);
    assert_eq!(reads(&h.feed(Input::Tick)), 1);
}

#[test]
fn a_dead_mount_is_detached_and_published_again() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let e = h.published("d");
    h.committed(&e);
    let e = h.at(Duration::from_secs(10), Input::Tick);
    assert!(e.iter().any(|x| matches!(x, Effect::Probe { .. })), "{e:?}");
    let e = h.feed(Input::Done(Completion::Probed {
        volume: key("d"),
        target: target("d"),
        probe: crate::node::health::Probe::Dead("ENOTCONN".into()),
    }));
    assert!(e.iter().any(|x| matches!(x, Effect::Detach { .. })));
    let mut e = h.feed(Input::MountTable(MountTable::default()));
    e.extend(h.feed(Input::Done(Completion::Detached {
        volume: key("d"),
        result: Ok(()),
    })));
    assert_eq!(publishes(&e), 1, "the plan publishes it again");
}

#[test]
fn messages_that_arrive_together_are_planned_once() {
    let names: Vec<String> = (0..50).map(|i| format!("v{i}")).collect();
    let vols: Vec<(&str, &str)> = names
        .iter()
        .map(|n| (n.as_str(), "multi-node-multi-writer"))
        .collect();
    let mut h = H::new(&vols, vec![]);
    let burst = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut a = alloc(&format!("a{i}"), &[n.as_str()], "pending", "run");
            a.modify_index = 10;
            Input::Watch(WatchEvent::Upsert(Box::new(a)))
        })
        .collect();
    let e = h.core.handle_all(burst, h.t);
    let c = commits(&e);
    assert_eq!(c.len(), 1);
    assert_eq!(publishes(c[0].1), 50);
}

// Issue 13 (security): an unreadable plugin directory and invalid volume keys.

#[test]
fn an_unreadable_plugin_directory_keeps_the_plugins_known_before() {
    let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("d"),
        result: Ok(Some("hv-1".into())),
    }));
    let mut e = h.feed(Input::Done(Completion::PluginsUnreadable {
        dir: "/p".into(),
        error: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
    }));
    // A catalogue change plans again with the plugins the core now knows.
    e.extend(h.at(
        Duration::from_secs(1),
        Input::Catalogue(crate::cluster::catalog::shared(BTreeMap::from([
            (key("d"), volume("d", "multi-node-multi-writer")),
            (key("e"), volume("e", "multi-node-multi-writer")),
        ]))),
    ));
    assert!(
        !e.iter()
            .any(|x| matches!(x, Effect::DeregisterPlaceholder { .. })),
        "a read error is not \"no plugins\": {e:?}"
    );
}

#[test]
fn a_volume_key_that_is_not_a_path_gets_no_target() {
    let mut h = H::new(&[], vec![]);
    let e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key(".."), volume("..", "multi-node-multi-writer"))]),
    )));
    assert!(
        !e.iter()
            .any(|x| matches!(x, Effect::RegisterPlaceholder { .. })),
        "{e:?}"
    );
}

/// Issue 37 #13: a volume waiting for another node's claim stops waiting (in the status
/// and in `dhv_binder_claims{state="waiting"}`) once the allocation that needed it ends.
#[test]
fn a_claim_wait_ends_with_the_allocation_that_waited() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Err(crate::cluster::claims::ClaimError::Held {
            volume: key("d"),
            holder: "job x".into(),
            job: Some("x".into()),
        }),
    }));
    let st = h.core.status();
    assert_eq!(st["waiting"].as_array().map(Vec::len), Some(1), "{st}");
    assert_eq!(h.core.claims_by_state().0, [0, 0, 0, 1]);
    // The node record says what the volume waits for here (issue 37 #10).
    let nv = h.core.node_volumes();
    assert!(nv["default/d"].waiting.contains("held by job x"), "{nv:?}");
    // Retried while the allocation waits: the wait stays, counted once (issue 46 #6).
    h.feed(Input::Tick);
    assert_eq!(h.core.claims_by_state().0, [0, 0, 0, 1]);
    h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Err(ClaimError::Held {
            volume: key("d"),
            holder: "job x".into(),
            job: Some("x".into()),
        }),
    }));
    let (begun, current, oldest) = h.core.claim_waits();
    assert_eq!((begun, current, oldest), (1, 1, Some(h.t)));
    let mut a = alloc(A1, &["d"], "complete", "stop");
    a.modify_index = 5;
    h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
    let st = h.core.status();
    assert_eq!(st["waiting"].as_array().map(Vec::len), Some(0), "{st}");
    assert_eq!(h.core.claims_by_state().0, [0, 0, 0, 0]);
    assert_eq!(h.core.claim_waits(), (1, 0, None));
    assert!(
        h.core
            .node_volumes()
            .get("default/d")
            .is_none_or(|v| v.waiting.is_empty()),
        "the wait is gone from the node record"
    );
}

/// Issue 44 #6: a failed publish's plugin words (redacted) reach the volume's own caller,
/// never the node record, which every node token reads in namespace default: there it is
/// what failed and that the words are in this node's log.
#[test]
fn the_node_record_carries_no_plugin_words() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc(A1, &["d"], "pending", "run")],
    );
    h.api_publish(7, A1, Duration::from_secs(30));
    let err = StepError::Plugin(crate::storage::plugin::PluginError::Failed {
        plugin: "bind".into(),
        op: crate::storage::plugin::Operation::Publish,
        status: "exit code 1".into(),
        message: "backend said: bucket team-a-secrets is gone".into(),
        stderr: String::new(),
        class: None,
    });
    let e = h.feed(Input::Done(Completion::Published {
        volume: key("d"),
        result: Err(err),
        elapsed: Duration::from_millis(1),
    }));
    match &replies(&e)[..] {
        [(7, Err(ApiError::PublishFailed { error, .. }))] => {
            assert!(error.contains("team-a-secrets"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    let shown = &h.core.node_volumes()["default/d"].error;
    assert!(!shown.contains("team-a-secrets"), "{shown}");
    assert!(
        shown.contains("plugin \"bind\" publish failed (exit code 1)")
            && shown.contains("agent's log on this node"),
        "{shown}"
    );
}

/// Issue 50: the tick runs the chores (a pass over every volume) at most every
/// `CHORES_EVERY` when nothing asked for them, and at once when a retry they wait on
/// came due: a placeholder whose registration failed is registered again at its retry,
/// not at the next 10 s pass.
#[test]
fn the_tick_runs_the_chores_every_ten_seconds_or_when_a_retry_comes_due() {
    let mut h = H::new(
        &[
            ("a", "multi-node-multi-writer"),
            ("b", "multi-node-multi-writer"),
            ("c", "multi-node-multi-writer"),
        ],
        vec![],
    );
    for v in ["a", "b", "c"] {
        h.feed(Input::Done(Completion::Placeholder {
            volume: key(v),
            result: Ok(Some(format!("hv-{v}"))),
        }));
    }
    // A tick 2 s later with nothing due: no pass over the volumes.
    let before = h.core.plan_visits();
    h.at(Duration::from_secs(2), Input::Tick);
    let quiet = h.core.plan_visits() - before;
    // 10 s after the last chores: the pass (placeholders and workers: twice the volumes).
    let before = h.core.plan_visits();
    h.at(CHORES_EVERY, Input::Tick);
    let periodic = h.core.plan_visits() - before;
    assert_eq!(
        periodic,
        quiet + 6,
        "quiet tick {quiet}, periodic tick {periodic}"
    );
    // A failed registration of a new volume's placeholder is retried at its deadline
    // (STEP_RETRY: about 1 s), between two periodic passes.
    let mut vols = h.core.volumes.clone();
    vols.insert(
        key("d"),
        std::sync::Arc::new(volume("d", "multi-node-multi-writer")),
    );
    let e = h.at(Duration::from_secs(1), Input::Catalogue(vols));
    assert!(
        e.iter().any(
            |x| matches!(x, Effect::RegisterPlaceholder { target: t, .. } if *t == target("d"))
        ),
        "{e:?}"
    );
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("d"),
        result: Err(crate::agent::executor::PlaceholderError::Nomad(
            crate::nomad::NomadError::Status {
                what: "host-volume-register".into(),
                status: 500,
                body: "no leader".into(),
            },
        )),
    }));
    let e = h.at(Duration::from_secs(2), Input::Tick);
    assert!(
        e.iter().any(
            |x| matches!(x, Effect::RegisterPlaceholder { target: t, .. } if *t == target("d"))
        ),
        "the registration is retried at its deadline, before the next periodic pass: {e:?}"
    );
}
