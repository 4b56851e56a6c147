//! Rule `symlink race` (issue 33 §3): a plugin that checks a path and then uses it again
//! can be steered out of its storage root by whoever may write along the path (a task
//! writing inside its own volume, when other storage lies below it), by swapping a directory
//! for a symlink between the check and the use. The kit does exactly that: test volumes are
//! made in a fresh directory `<param>/kit-race-…` beneath each parameter that names an
//! existing directory, that directory's tree is copied outside the roots (marked), and a
//! thread then swaps the directory with a symlink to the copy (`renameat2(RENAME_EXCHANGE)`,
//! atomically, every few hundred microseconds) while the kit publishes, creates and deletes.
//! The plugin fails if anything outside was mounted, created or removed.
//!
//! Then, when the plugin declares snapshots or clones, the same swap **inside** a volume
//! (issue 44 §2): a copy that walks a volume by name (`cp -a`) follows a directory that the
//! volume's task swaps for a symlink while the copy is inside it, and copies what the symlink
//! points at. The kit publishes a race volume, writes a directory of files into it through
//! the mount (as its task would), and swaps that directory with a symlink to a directory
//! outside the roots holding the same names (root-only files whose contents say they are from
//! outside) while it takes snapshots and clones of the volume; then it swaps the same
//! directory inside a snapshot's own storage (found beneath the parameter's directory by a
//! file only that snapshot holds; skipped for storage that is not a directory tree there,
//! such as an image file) while it creates volumes from that snapshot. Every snapshot (by a
//! volume created from it, without the race), clone and new volume is published and read,
//! no symlink followed: any file from outside fails the plugin, with the count.

use super::{strict_object, Kit};
use crate::cluster::snapshot::{self, SnapshotRecord};
use crate::storage::environment;
use crate::storage::plugin::{Capability, Operation};
use crate::volume::{VolumeRecord, VolumeSource, VolumeState};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RULE: &str = "symlink race";
/// At most this many publishes (each followed by an unpublish) while racing.
const PUBLISHES: usize = 40;
/// At most this many creates while racing.
const CREATES: usize = 20;
/// Volumes made before the race, their storage copied outside, each deleted while racing.
const DELETES: usize = 6;
/// The longest each phase races.
const PHASE: Duration = Duration::from_secs(4);
/// The marker file put in every directory of the copy outside.
const MARKER: &str = ".kit-outside";
/// At least this many rounds of snapshot and clone while racing inside (each phase then
/// ends after `PHASE`)...
const INSIDE_COPIES: usize = 4;
/// ...and at most this many, within `INSIDE_LONGEST`: a copy by name often fails outright
/// when the swap lands mid-copy (`cp`: "replaced while being copied"), and a loaded machine
/// can fail every round of the first `PHASE`, which proves nothing either way. The phase goes
/// on until some copy made during the swap succeeded.
const INSIDE_COPIES_MAX: usize = 16;
/// The longest a phase inside a volume races while no copy made during the swap succeeded.
const INSIDE_LONGEST: Duration = Duration::from_secs(20);
/// Files in the directory swapped inside a volume (and in its counterpart outside).
const INSIDE_FILES: usize = 40;
/// The contents of every file of the directory outside that the inside swap points at.
const FROM_OUTSIDE: &str = "kit: a root-only file from outside the storage roots";

/// Every file and directory under `dir` (relative path, kind and size), for "nothing
/// outside created or removed".
fn listing(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap_or(&p).display().to_string();
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => {
                    out.insert(format!("{rel}/"));
                    walk(base, &p, out);
                }
                Ok(m) => {
                    out.insert(format!("{rel} ({} bytes)", m.len()));
                }
                Err(_) => {}
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

/// Puts the marker in every directory under `dir` (itself included).
fn mark(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join(MARKER), "outside the storage roots")?;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            mark(&e.path())?;
        }
    }
    Ok(())
}

/// What shows that `target` is mounted from outside: the marker in it (a directory from
/// the copy), or a loop device whose backing file lies in the copy.
fn escaped(target: &Path, outside: &Path) -> Option<String> {
    if target.join(MARKER).exists() {
        return Some(format!(
            "{} shows the copy outside the roots",
            target.display()
        ));
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let t = target.display().to_string();
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f.get(4) != Some(&t.as_str()) {
            continue;
        }
        let source = line.split(" - ").nth(1)?.split(' ').nth(1)?;
        let dev = source.strip_prefix("/dev/")?;
        let back = std::fs::read_to_string(format!("/sys/block/{dev}/loop/backing_file"))
            .unwrap_or_default();
        if Path::new(back.trim()).starts_with(outside) {
            return Some(format!(
                "{} is {source}, backed by {} outside the roots",
                target.display(),
                back.trim()
            ));
        }
    }
    None
}

/// The swapper: exchanges `dir` and `link` (a symlink to the copy outside) until `stop`,
/// then leaves `dir` a directory again. Returns the number of swaps.
fn swapper(dir: PathBuf, link: PathBuf, stop: Arc<AtomicBool>, swaps: Arc<AtomicUsize>) {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    let mut flipped = false;
    while !stop.load(Ordering::Relaxed) {
        if renameat_with(CWD, &dir, CWD, &link, RenameFlags::EXCHANGE).is_ok() {
            flipped = !flipped;
            swaps.fetch_add(1, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_micros(300));
    }
    if flipped {
        let _ = renameat_with(CWD, &dir, CWD, &link, RenameFlags::EXCHANGE);
    }
}

/// The test volume redirected beneath the race directories (`params` replaced).
fn race_volume(kit: &Kit, i: usize, params: &[(String, PathBuf)]) -> VolumeRecord {
    let mut rec = kit.rec.clone();
    rec.id = uuid::Uuid::new_v4().to_string();
    rec.spec.name = format!("conformance-race-{i}");
    rec.spec.source = VolumeSource::Empty;
    rec.context = serde_json::Value::Null;
    for (k, dir) in params {
        rec.spec
            .parameters
            .insert(k.clone(), dir.display().to_string());
    }
    rec
}

/// Creates `rec`; on success stores its context in it.
async fn create(kit: &mut Kit, rec: &mut VolumeRecord) -> Result<(), String> {
    let env = environment::create_env(&kit.node, rec);
    let c = kit.call(Operation::Create, &env).await;
    let out = c.result.map_err(|e| e.report())?;
    rec.context = strict_object(&out)?
        .get("context")
        .cloned()
        .unwrap_or_default();
    Ok(())
}

pub(super) async fn race_rule(kit: &mut Kit) {
    let params: Vec<(String, PathBuf)> = kit
        .rec
        .spec
        .parameters
        .iter()
        .filter(|(_, v)| v.starts_with('/') && Path::new(v).is_dir())
        .map(|(k, v)| (k.clone(), PathBuf::from(v)))
        .collect();
    if params.is_empty() {
        return kit.report.not_run(
            RULE,
            "no parameter names an existing directory: nothing the kit can race (give the storage directory as --param KEY=/dir)",
        );
    }
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let outside = kit.scratch.join(format!("race-outside-{tag}"));
    // Per path parameter: the race directory beneath it, its swap partner, its copy outside.
    let mut races = Vec::new();
    for (i, (k, p)) in params.iter().enumerate() {
        let real = p.canonicalize().unwrap_or(p.clone());
        races.push((
            k.clone(),
            real.join(format!("kit-race-{tag}")),
            real.join(format!("kit-race-{tag}.swap")),
            outside.join(i.to_string()),
        ));
    }
    let verdict = race(kit, &races, &outside).await;
    // Clean up without the race: the test volumes deleted by the plugin, then whatever is left.
    for (_, dir, link, _) in &races {
        let _ = std::fs::remove_file(link);
        if let Ok(m) = std::fs::symlink_metadata(dir) {
            if m.file_type().is_symlink() {
                let _ = std::fs::remove_file(dir);
            }
        }
    }
    let mut left = crate::node::mounts::mounts_under(&kit.scratch);
    left.retain(|m| m.starts_with(&outside));
    for m in left {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    for (_, dir, _, _) in &races {
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_dir_all(&outside);
    match verdict {
        Ok(evidence) => kit.report.push(RULE, true, evidence),
        Err(evidence) => kit.report.push(RULE, false, evidence),
    }
}

async fn race(
    kit: &mut Kit,
    races: &[(String, PathBuf, PathBuf, PathBuf)],
    outside: &Path,
) -> Result<String, String> {
    let redirected: Vec<(String, PathBuf)> = races
        .iter()
        .map(|(k, dir, _, _)| (k.clone(), dir.clone()))
        .collect();
    for (_, dir, link, copy) in races {
        std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::create_dir_all(copy))
            .and_then(|_| std::os::unix::fs::symlink(copy, link))
            .map_err(|e| format!("cannot prepare the race directory {}: {e}", dir.display()))?;
    }
    // The volumes, made before the race: one to publish, DELETES to delete.
    let mut vols = Vec::new();
    for i in 0..=DELETES {
        let mut rec = race_volume(kit, i, &redirected);
        create(kit, &mut rec).await.map_err(|e| {
            format!("cannot create a test volume beneath the race directory (no race yet): {e}")
        })?;
        vols.push(rec);
    }
    // Their storage copied outside the roots, every directory marked.
    for (_, dir, _, copy) in races {
        let out = std::process::Command::new("cp")
            .args(["-a", "--sparse=always"])
            .arg(format!("{}/.", dir.display()))
            .arg(copy)
            .output()
            .map_err(|e| format!("cannot run cp to copy {}: {e}", dir.display()))?;
        if !out.status.success() {
            return Err(format!(
                "cannot copy {} outside: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        mark(copy).map_err(|e| format!("cannot mark the copy {}: {e}", copy.display()))?;
    }
    let before = listing(outside);
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = races
        .iter()
        .map(|(_, dir, link, _)| {
            let (d, l, s, n) = (dir.clone(), link.clone(), stop.clone(), swaps.clone());
            std::thread::spawn(move || swapper(d, l, s, n))
        })
        .collect();
    let result = attacks(kit, &mut vols, &redirected, outside, &before).await;
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let after = listing(outside);
    let (mut notes, mut escapes) = result;
    if after != before {
        let gone: Vec<_> = before.difference(&after).take(5).collect();
        let new: Vec<_> = after.difference(&before).take(5).collect();
        escapes.push(format!(
            "outside the roots, removed {gone:?} and created {new:?}"
        ));
    }
    if super::storage::has(kit, Capability::Snapshot) || super::storage::has(kit, Capability::Clone)
    {
        let (n, e) = inside(kit, &vols[0], &redirected, outside).await;
        notes.extend(n);
        escapes.extend(e);
    }
    // Without the race: everything the kit made is deleted by the plugin.
    for rec in &vols {
        let env = environment::delete_env(&kit.node, rec);
        kit.call(Operation::Delete, &env).await;
    }
    notes.push(format!(
        "{} swaps of {} with a symlink to a copy outside the roots",
        swaps.load(Ordering::Relaxed),
        races
            .iter()
            .map(|(_, d, _, _)| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if escapes.is_empty() {
        Ok(format!(
            "{}; nothing outside mounted, created or removed",
            notes.join("; ")
        ))
    } else {
        Err(format!(
            "ESCAPED: {}; {}",
            escapes.join("; "),
            notes.join("; ")
        ))
    }
}

/// Publishes, creates and deletes while the swappers run; returns (notes, escapes).
async fn attacks(
    kit: &mut Kit,
    vols: &mut Vec<VolumeRecord>,
    redirected: &[(String, PathBuf)],
    outside: &Path,
    before: &BTreeSet<String>,
) -> (Vec<String>, Vec<String>) {
    let mut notes = Vec::new();
    let mut escapes = Vec::new();
    // Publish (then unpublish) the first volume.
    let target = kit.target("race");
    let _ = std::fs::create_dir_all(&target);
    let (mut n, mut mounted) = (0, 0);
    let start = Instant::now();
    while n < PUBLISHES && start.elapsed() < PHASE {
        n += 1;
        let rec = vols[0].clone();
        let env = kit.publish_env_of(&rec, &target, false);
        let c = kit.call(Operation::Publish, &env).await;
        if crate::node::mounts::is_mount_point(&target) {
            mounted += 1;
            if let Some(e) = escaped(&target, outside) {
                escapes.push(format!("publish {n}: {e}"));
            }
        }
        let ctx = c
            .result
            .ok()
            .and_then(|o| strict_object(&o).ok())
            .and_then(|v| v.get("context").cloned())
            .unwrap_or_default();
        let env = kit.unpublish_env_of(&rec, &target, &ctx);
        kit.call(Operation::Unpublish, &env).await;
        while crate::node::mounts::is_mount_point(&target) {
            if nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
    }
    notes.push(format!("{n} publishes ({mounted} mounted)"));
    // Create new volumes.
    let (mut n, mut made) = (0, 0);
    let start = Instant::now();
    while n < CREATES && start.elapsed() < PHASE {
        n += 1;
        let mut rec = race_volume(kit, 100 + n, redirected);
        if create(kit, &mut rec).await.is_ok() {
            made += 1;
        }
        let now = listing(outside);
        if let Some(new) = now.difference(before).next() {
            escapes.push(format!("create {n}: made {new} outside the roots"));
            break;
        }
        vols.push(rec);
    }
    notes.push(format!("{n} creates ({made} succeeded)"));
    // Delete each volume made before the race, three times.
    let (mut n, mut ok) = (0, 0);
    let start = Instant::now();
    'deletes: for rec in vols.iter().skip(1).take(DELETES) {
        for _ in 0..3 {
            if start.elapsed() >= PHASE {
                break 'deletes;
            }
            n += 1;
            let env = environment::delete_env(&kit.node, rec);
            if kit.call(Operation::Delete, &env).await.ok() {
                ok += 1;
            }
            let now = listing(outside);
            if let Some(gone) = before.difference(&now).next() {
                escapes.push(format!("delete {n}: removed {gone} outside the roots"));
                break 'deletes;
            }
        }
    }
    notes.push(format!("{n} deletes ({ok} succeeded)"));
    (notes, escapes)
}

/// What a copy holds from outside: files under `dir` (no symlink followed) with the contents
/// [`FROM_OUTSIDE`] or named [`MARKER`].
fn from_outside(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let p = e.path();
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => n += from_outside(&p),
            Ok(m)
                if m.is_file()
                    && (e.file_name() == MARKER
                        || std::fs::read(&p).is_ok_and(|b| b == FROM_OUTSIDE.as_bytes())) =>
            {
                n += 1;
            }
            _ => {}
        }
    }
    n
}

/// The directory beneath `dirs` (no symlink followed, no mount crossed, at most 6 levels)
/// that holds a file named `name`.
fn holding(dirs: &[PathBuf], name: &str) -> Option<PathBuf> {
    fn find(dir: &Path, name: &str, dev: u64, depth: usize) -> Option<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        if dir.join(name).symlink_metadata().is_ok() {
            return Some(dir.to_path_buf());
        }
        if depth == 0 {
            return None;
        }
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() && m.dev() == dev => {
                    if let Some(f) = find(&p, name, dev, depth - 1) {
                        return Some(f);
                    }
                }
                _ => {}
            }
        }
        None
    }
    use std::os::unix::fs::MetadataExt;
    dirs.iter().find_map(|d| {
        let dev = std::fs::metadata(d).ok()?.dev();
        find(d, name, dev, 6)
    })
}

/// Makes `dir/kit-inside` (INSIDE_FILES files and a subdirectory, contents "inside"), its
/// counterpart `outside` (the same names, root-only, contents [`FROM_OUTSIDE`], marked) and
/// the symlink `dir/kit-inside.swap` to it. Returns (directory, symlink).
fn plant_inside(dir: &Path, outside: &Path) -> std::io::Result<(PathBuf, PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    let (d, link) = (dir.join("kit-inside"), dir.join("kit-inside.swap"));
    for base in [&d, &outside.to_path_buf()] {
        std::fs::create_dir_all(base.join("deeper"))?;
    }
    for rel in (0..INSIDE_FILES)
        .map(|i| format!("f{i}"))
        .chain(["deeper/g".to_string()])
    {
        std::fs::write(d.join(&rel), "inside")?;
        let o = outside.join(&rel);
        std::fs::write(&o, FROM_OUTSIDE)?;
        std::fs::set_permissions(&o, std::fs::Permissions::from_mode(0o600))?;
    }
    mark(outside)?;
    std::os::unix::fs::symlink(outside, &link)?;
    Ok((d, link))
}

/// Runs `swapper` on (dir, link) while `work` runs; returns the work's output and the swaps.
/// The swapper runs in a mount namespace of its own, a copy of the host's that receives its
/// mounts (slave), as a task's does: a remount of the host's mount (read-only for a
/// snapshot) does not reach its copy, so it goes on writing as a task would.
async fn swapping<T>(
    dir: &Path,
    link: &Path,
    work: impl std::future::Future<Output = T>,
) -> (T, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicUsize::new(0));
    let t = {
        let (d, l, s, n) = (
            dir.to_path_buf(),
            link.to_path_buf(),
            stop.clone(),
            swaps.clone(),
        );
        std::thread::spawn(move || {
            use nix::mount::{mount, MsFlags};
            // A thread may unshare its mount namespace (CLONE_NEWNS implies CLONE_FS).
            if nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).is_ok() {
                let _ = mount(
                    None::<&str>,
                    "/",
                    None::<&str>,
                    MsFlags::MS_REC | MsFlags::MS_SLAVE,
                    None::<&str>,
                );
            }
            swapper(d, l, s, n)
        })
    };
    let out = work.await;
    stop.store(true, Ordering::Relaxed);
    let _ = t.join();
    (out, swaps.load(Ordering::Relaxed))
}

/// Creates `rec` with the source variables `extra`; returns its context.
async fn create_from(
    kit: &mut Kit,
    rec: &VolumeRecord,
    extra: Vec<(String, String)>,
) -> Result<serde_json::Value, String> {
    let mut env = environment::create_env(&kit.node, rec);
    env.extend(extra);
    let c = kit.call(Operation::Create, &env).await;
    let out = c.result.map_err(|e| e.report())?;
    Ok(strict_object(&out)?
        .get("context")
        .cloned()
        .unwrap_or_default())
}

/// Publishes `rec` (without the race), counts the files from outside in it, unpublishes and
/// deletes it. `Err` when it cannot be read.
async fn outside_files_in(kit: &mut Kit, rec: &VolumeRecord) -> Result<usize, String> {
    let t = kit.target("race-check");
    let pctx = kit.publish_rec(rec, &t, false).await?;
    let n = from_outside(&t);
    let u = kit.unpublish_rec(rec, &t, &pctx).await;
    let env = environment::delete_env(&kit.node, rec);
    kit.call(Operation::Delete, &env).await;
    u.map(|_| n)
}

/// Whether a phase of the race inside a volume ends before round `round`: after
/// `INSIDE_COPIES` rounds and `PHASE` once `made` copies succeeded, at `INSIDE_LONGEST`
/// regardless.
fn inside_phase_over(round: usize, made: usize, elapsed: Duration) -> bool {
    elapsed >= INSIDE_LONGEST || (made > 0 && (round >= INSIDE_COPIES || elapsed >= PHASE))
}

/// The race inside a volume during `snapshot_create`, `clone` and create-from-snapshot (see
/// the module's documentation); returns (notes, escapes).
async fn inside(
    kit: &mut Kit,
    vol: &VolumeRecord,
    redirected: &[(String, PathBuf)],
    outside: &Path,
) -> (Vec<String>, Vec<String>) {
    let (mut notes, mut escapes) = (Vec::new(), Vec::new());
    let snapshots = super::storage::has(kit, Capability::Snapshot);
    let clones = super::storage::has(kit, Capability::Clone);
    let t = kit.target("race-inside");
    let pctx = match kit.publish_rec(vol, &t, false).await {
        Ok(c) => c,
        Err(e) => {
            escapes.push(format!(
                "cannot publish a race volume to race inside it (no race): {e}"
            ));
            return (notes, escapes);
        }
    };
    let (dir, link) = match plant_inside(&t, &outside.join("inside")) {
        Ok(p) => p,
        Err(e) => {
            escapes.push(format!("cannot write into the published race volume: {e}"));
            let _ = kit.unpublish_rec(vol, &t, &pctx).await;
            return (notes, escapes);
        }
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    };
    // A snapshot taken before the race, found later by the file only it holds.
    let sentinel = format!("kit-only-in-snapshot-{}", uuid::Uuid::new_v4().simple());
    let mut first: Option<SnapshotRecord> = None;
    if snapshots && std::fs::write(t.join(&sentinel), "s").is_ok() {
        let mut snap = SnapshotRecord::new(vol, "race-before", now());
        let env = snapshot::create_env(&kit.node, vol, &snap, Some(&t));
        let c = kit.call(Operation::SnapshotCreate, &env).await;
        match c
            .result
            .map_err(|e| e.report())
            .and_then(|o| strict_object(&o))
        {
            Ok(v) => {
                snap.context = v.get("context").cloned().unwrap_or_default();
                snap.state = VolumeState::Ready;
                first = Some(snap);
            }
            Err(e) => escapes.push(format!("snapshot_create without the race failed: {e}")),
        }
        let _ = std::fs::remove_file(t.join(&sentinel));
    }
    // Snapshots and clones while the directory inside the volume is swapped.
    let ((snaps, cloned, failed, first_error), swaps) = swapping(&dir, &link, async {
        let (mut snaps, mut cloned, mut failed) = (Vec::new(), Vec::new(), 0);
        let mut first_error: Option<String> = None;
        let start = Instant::now();
        for i in 0..INSIDE_COPIES_MAX {
            let made = snaps.len() + cloned.len();
            if inside_phase_over(i, made, start.elapsed()) {
                break;
            }
            if snapshots {
                let mut snap = SnapshotRecord::new(vol, &format!("race-{i}"), now());
                let env = snapshot::create_env(&kit.node, vol, &snap, Some(&t));
                let c = kit.call(Operation::SnapshotCreate, &env).await;
                match c
                    .result
                    .map_err(|e| e.report())
                    .and_then(|o| strict_object(&o))
                {
                    Ok(v) => {
                        snap.context = v.get("context").cloned().unwrap_or_default();
                        snap.state = VolumeState::Ready;
                        snaps.push(snap);
                    }
                    Err(e) => {
                        failed += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            if clones {
                let mut rec = race_volume(kit, 200 + i, redirected);
                rec.spec.source = VolumeSource::CloneId(vol.spec.name.clone());
                match snapshot::source_env(&rec, None, Some(vol), Some(&t)) {
                    Ok(extra) => match create_from(kit, &rec, extra).await {
                        Ok(ctx) => {
                            rec.context = ctx;
                            cloned.push(rec);
                        }
                        Err(e) => {
                            failed += 1;
                            first_error.get_or_insert(e);
                        }
                    },
                    Err(_) => failed += 1,
                }
            }
        }
        (snaps, cloned, failed, first_error)
    })
    .await;
    let _ = std::fs::remove_file(&link);
    if let Err(e) = kit.unpublish_rec(vol, &t, &pctx).await {
        notes.push(format!("unpublish of the race volume: {e}"));
    }
    notes.push(format!(
        "inside the volume: {} snapshot(s) and {} clone(s) ({failed} failed{}) while {} was swapped {swaps} times with a symlink outside the roots",
        snaps.len(),
        cloned.len(),
        first_error.map(|e| format!(", the first: {}", super::short(&e))).unwrap_or_default(),
        dir.display()
    ));
    if snaps.is_empty() && cloned.is_empty() {
        escapes.push(format!(
            "no snapshot or clone made while the directory inside the volume was swapped succeeded ({failed} failed): the copy cannot be judged; a copy by handle succeeds under the swap"
        ));
    }
    // Creates from the first snapshot while the same directory in its storage is swapped.
    let mut restored = Vec::new();
    if let Some(snap) = &first {
        let roots: Vec<PathBuf> = redirected.iter().map(|(_, d)| d.clone()).collect();
        match holding(&roots, &sentinel) {
            Some(sdir) => {
                let (sd, sl) = (sdir.join("kit-inside"), sdir.join("kit-inside.swap"));
                // The snapshot holds the volume's own swap symlink (copied as a link).
                let _ = std::fs::remove_file(&sl);
                let planted = std::os::unix::fs::symlink(outside.join("inside"), &sl);
                if sd.is_dir() && planted.is_ok() {
                    let ((made, failed), swaps) = swapping(&sd, &sl, async {
                        let (mut made, mut failed) = (Vec::new(), 0);
                        let start = Instant::now();
                        for i in 0..INSIDE_COPIES_MAX {
                            if inside_phase_over(i, made.len(), start.elapsed()) {
                                break;
                            }
                            let mut rec = race_volume(kit, 300 + i, redirected);
                            rec.spec.source = VolumeSource::SnapshotId(snap.id.clone());
                            let extra = snapshot::source_env(&rec, Some(snap), None, None);
                            match extra {
                                Ok(extra) => match create_from(kit, &rec, extra).await {
                                    Ok(ctx) => {
                                        rec.context = ctx;
                                        made.push(rec);
                                    }
                                    Err(_) => failed += 1,
                                },
                                Err(_) => failed += 1,
                            }
                        }
                        (made, failed)
                    })
                    .await;
                    notes.push(format!(
                        "{} create(s) from a snapshot ({failed} failed) while {} in its storage was swapped {swaps} times",
                        made.len(),
                        sd.display()
                    ));
                    restored = made;
                }
                let _ = std::fs::remove_file(&sl);
            }
            None => notes.push(
                "the snapshot's storage holds no directory tree beneath the parameter's directory: no swap inside it during create from snapshot".into(),
            ),
        }
    }
    // Read every copy without the race.
    let count = |what: String, n: Result<usize, String>, escapes: &mut Vec<String>| match n {
        Ok(0) => {}
        Ok(n) => escapes.push(format!("{what} holds {n} file(s) from outside the roots")),
        Err(e) => escapes.push(format!("{what} cannot be read: {e}")),
    };
    let mut total = 0usize;
    for (i, snap) in snaps.iter().enumerate() {
        let mut rec = race_volume(kit, 400 + i, redirected);
        rec.spec.source = VolumeSource::SnapshotId(snap.id.clone());
        let n = match snapshot::source_env(&rec, Some(snap), None, None) {
            Ok(extra) => match create_from(kit, &rec, extra).await {
                Ok(ctx) => {
                    rec.context = ctx;
                    outside_files_in(kit, &rec).await
                }
                Err(e) => Err(format!("(a volume created from it failed: {e})")),
            },
            Err(e) => Err(e.to_string()),
        };
        total += *n.as_ref().unwrap_or(&0);
        count(
            format!("snapshot {} taken during the swap", i + 1),
            n,
            &mut escapes,
        );
        let env = snapshot::delete_env(&kit.node, snap);
        kit.call(Operation::SnapshotDelete, &env).await;
    }
    for (what, list) in [
        ("clone", cloned),
        ("volume created from a snapshot", restored),
    ] {
        for (i, rec) in list.iter().enumerate() {
            let n = outside_files_in(kit, rec).await;
            total += *n.as_ref().unwrap_or(&0);
            count(
                format!("{what} {} made during the swap", i + 1),
                n,
                &mut escapes,
            );
        }
    }
    if let Some(snap) = &first {
        let env = snapshot::delete_env(&kit.node, snap);
        kit.call(Operation::SnapshotDelete, &env).await;
    }
    notes.push(format!(
        "{total} file(s) from outside the roots in the copies"
    ));
    (notes, escapes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_inside_a_volume_races_on_until_a_copy_made_during_the_swap_succeeds() {
        let s = Duration::from_secs;
        // Nothing succeeded yet: neither the rounds nor PHASE end it, INSIDE_LONGEST does.
        assert!(!inside_phase_over(INSIDE_COPIES, 0, PHASE + s(1)));
        assert!(inside_phase_over(1, 0, INSIDE_LONGEST));
        // One copy succeeded: the usual bounds.
        assert!(!inside_phase_over(1, 1, s(1)));
        assert!(inside_phase_over(INSIDE_COPIES, 1, s(1)));
        assert!(inside_phase_over(1, 1, PHASE));
    }
}
