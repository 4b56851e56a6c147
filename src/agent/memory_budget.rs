//! Heap per allocation, per published volume and per record, counted (issue 50: at most
//! 2 KiB of heap per published volume and per record on the whole agent; docs/scale.md,
//! "Memory per allocation"). The lib's test binary runs on the agent's allocator and reads
//! its per-thread counters ([`live`]): a test builds one structure for `N` volumes on its
//! own thread and divides what stays allocated by `N`. Each budget is that structure's
//! share, between what it measures and what it measured before the cuts: a change that
//! copies records again, or keeps a map node per volume, exceeds it.

use crate::agent::reconcile::tests::{key, volume};
use crate::agent::view::View;
use crate::cluster::catalog::Catalogue;
use crate::node::journal::{EventKind, MountRecord, MountState, Store, UserKey};
use crate::nomad::types::Allocation;

/// The lib's tests run on the agent's allocator, whose per-thread counters
/// (`thread.allocatedp`, `thread.deallocatedp`) give the bytes each test's own thread holds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Bytes allocated minus bytes freed on this thread, as the allocator's size classes count
/// them. Panics when the allocator's statistics cannot be read.
fn live() -> isize {
    let allocated = tikv_jemalloc_ctl::thread::allocatedp::read().expect("thread.allocatedp");
    let freed = tikv_jemalloc_ctl::thread::deallocatedp::read().expect("thread.deallocatedp");
    allocated.get() as isize - freed.get() as isize
}

/// Volumes per measurement: enough for the maps' nodes to average out.
const N: usize = 1000;

/// The heap `build` leaves allocated (in what it returns), per volume.
fn per_volume<T>(build: impl FnOnce() -> T) -> (T, usize) {
    let before = live();
    let kept = build();
    let bytes = (live() - before).max(0) as usize;
    (kept, bytes / N)
}

/// An allocation as Nomad sends it on a node's list: the job with its group, one host
/// volume and one task, and the task's state with its times and events (the agent's watch
/// decodes this shape, `nomad::types::ListedAlloc::decode`). `per_alloc`: the group's
/// volume is `vol` with `per_alloc` (every allocation of the job has the same Job); else
/// each allocation's group names its own volume (`vol-<i>`), as the scale bench's do.
fn nomad_alloc(i: usize, per_alloc: bool) -> Allocation {
    let vol = if per_alloc {
        "vol".to_string()
    } else {
        format!("vol-{i:04}")
    };
    let json = serde_json::json!({
        "ID": format!("{:08x}-0000-4000-8000-{:012x}", i, i), "Namespace": "default",
        "Name": format!("job.g[{i}]"), "NodeID": "9f3c1a52-5d7e-4c4b-8f7e-2d9f6c1b0a11",
        "JobID": "job", "TaskGroup": "g", "DesiredStatus": "run", "ClientStatus": "running",
        "ModifyIndex": 10, "AllocModifyIndex": 10, "CreateIndex": 10,
        "Job": {"ID": "job", "Namespace": "default", "Type": "service", "Version": 0,
            "TaskGroups": [{"Name": "g", "ShutdownDelay": null,
                "Volumes": {"data": {"Name": "data", "Type": "host", "Source": vol,
                    "ReadOnly": false, "Sticky": false, "AccessMode": "single-node-writer",
                    "AttachmentMode": "file-system", "MountOptions": null, "PerAlloc": per_alloc}},
                "Tasks": [{"Name": "app", "Driver": "exec", "Lifecycle": null,
                    "VolumeMounts": [{"Volume": "data", "Destination": "/data",
                        "ReadOnly": false, "PropagationMode": "private"}],
                    "KillTimeout": 5_000_000_000u64, "ShutdownDelay": 0}]}]},
        "TaskStates": {"app": {"State": "running", "Failed": false, "Restarts": 0,
            "LastRestart": null, "StartedAt": "2026-12-07T05:00:00.123456789Z",
            "FinishedAt": null, "Events": []}}
    });
    // From bytes, as the watch decodes them (a list's length is not known ahead there).
    serde_json::from_slice(json.to_string().as_bytes()).expect("an allocation")
}

/// The view keeps each allocation boxed with only its own group, indexed by volume in a
/// sorted `Vec`, its short strings (names, statuses) in place, its ID as one string shared
/// by the allocation, the map and the index, and the node's ID as one string for all: a
/// map node of eleven slots per allocation, or per one-allocation set, a heap string per
/// name, or a copy of an ID per holder, exceeds the budget (1,238 bytes; 1,285 with a node
/// ID per allocation, 1,394 with an ID per holder, 1,618 with a `String` per name).
#[test]
fn the_view_keeps_an_allocation_in_at_most_1344_bytes() {
    let (view, bytes) = per_volume(|| {
        let mut v = View::default();
        for a in (0..N).map(|i| nomad_alloc(i, false)) {
            v.upsert(a);
        }
        v.take_changes();
        v
    });
    assert_eq!(view.allocs().len(), N);
    assert!(
        bytes <= 1344,
        "the view keeps {bytes} bytes per allocation (budget 1,344)"
    );
}

/// The allocations of one job version (`count = 1000` with `per_alloc` volumes) share one
/// reduced Job in the view: a Job kept per allocation exceeds the budget (621 bytes).
#[test]
fn the_allocations_of_one_job_version_cost_the_view_at_most_704_bytes_each() {
    let (view, bytes) = per_volume(|| {
        let mut v = View::default();
        for a in (0..N).map(|i| nomad_alloc(i, true)) {
            v.upsert(a);
        }
        v.take_changes();
        v
    });
    assert_eq!(view.named_volumes().count(), N);
    assert!(
        bytes <= 704,
        "the view keeps {bytes} bytes per allocation of one job version (budget 704)"
    );
}

/// The journal's mount records are shared with the commit, the index by target and the
/// store's copy (which applies the commit's records, keyed by each record's own volume);
/// a publish intent's allocation ID goes with its outcome, a user record's allocation ID
/// is one string shared by the record, its index and the store's copy, and a record's
/// rarely set fields (its publish context, its claim's lock ID) are boxed: a copy of each
/// record, target, key or allocation ID per holder, an ID kept per published volume, or a
/// record past the allocator's 256-byte class, exceeds the budget (1,221 bytes).
#[test]
fn the_journal_and_the_stores_copy_keep_a_published_volume_in_at_most_1_25_kib() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (kept, bytes) = per_volume(|| {
        let (store, mut j) = Store::open(dir.path(), "node-1").expect("a store");
        for i in 0..N {
            let name = format!("vol-{i:04}");
            let alloc = format!("{:08x}-0000-4000-8000-{:012x}", i, i);
            // The journal tests' fixture, with this volume's key, ID and target.
            let record = |state| MountRecord {
                volume: key(&name),
                volume_id: format!("{:08x}-1111-4000-8000-{:012x}", i, i),
                target: format!("/var/lib/dhv-binder/mounts/default/{name}").into(),
                ..crate::node::journal::tests::rec(state)
            };
            // As the agent publishes: the intent, naming the allocation, then the outcome.
            j.set_mount(
                record(MountState::Publishing),
                EventKind::PublishIntent,
                Some(&alloc),
            );
            j.set_mount(record(MountState::Published), EventKind::PublishDone, None);
            j.change_users(
                &[UserKey {
                    alloc_id: alloc.into(),
                    volume: key(&name),
                }],
                &[],
            );
        }
        // Written (the store's copy takes the records) and gone, as after the loop's commit.
        let commit = j.take_commit().expect("a commit");
        store.write(&commit).expect("the commit is written");
        drop(commit);
        j.take_touched();
        (store, j)
    });
    assert_eq!(kept.1.mounts().len(), N);
    assert!(
        bytes <= 1280,
        "the journal and the store's copy keep {bytes} bytes per published volume (budget 1,280)"
    );
}

/// A catalogue snapshot (what the record watch sends the loop at every change) shares its
/// records with the watch's cache: it costs its map, not a copy of each record.
#[test]
fn a_catalogue_snapshot_costs_at_most_256_bytes_per_record() {
    let cache: Catalogue = (0..N)
        .map(|i| {
            let name = format!("vol-{i:04}");
            (key(&name), volume(&name, "single-node-writer").into())
        })
        .collect();
    let (snapshot, bytes) = per_volume(|| cache.clone());
    assert_eq!(snapshot.len(), N);
    assert!(
        bytes <= 256,
        "a catalogue snapshot costs {bytes} bytes per record (budget 256)"
    );
}

/// The host's mount table as the agent keeps it between readings (`MountTable::parse`): a
/// mount of a published volume, as the scale bench's bind volumes show in
/// `/proc/1/mountinfo`. One entry with its five strings in one allocation, and its place
/// in the index by mount point: 165 bytes (288 when each string was its own `String` or
/// `PathBuf`).
#[test]
fn a_mount_table_keeps_a_mount_in_at_most_192_bytes() {
    let text: String = (0..N)
        .map(|i| {
            format!(
                "{} 29 8:1 /tmp/.tmpQk3vZp/src/vol-{i:04} /var/lib/dhv-binder/mounts/default/vol-{i:04} rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro\n",
                1000 + i
            )
        })
        .collect();
    let (table, bytes) = per_volume(|| {
        crate::node::mounts::MountTable::parse(text.as_bytes(), std::path::Path::new("test"))
            .expect("a table")
    });
    assert_eq!(table.entries().len(), N);
    assert!(
        bytes <= 192,
        "a mount table keeps {bytes} bytes per mount (budget 192)"
    );
}
