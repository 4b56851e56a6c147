//! Rule `symlink race` (issue 33 §3): a plugin that checks a path and then uses it again
//! can be steered out of its storage root by whoever may write along the path (a task
//! writing inside its own volume, when other storage lies below it), by swapping a directory
//! for a symlink between the check and the use. The kit does exactly that: test volumes are
//! made in a fresh directory `<param>/kit-race-…` beneath each parameter that names an
//! existing directory, that directory's tree is copied outside the roots (marked), and a
//! thread then swaps the directory with a symlink to the copy (`renameat2(RENAME_EXCHANGE)`,
//! atomically, every few hundred microseconds) while the kit publishes, creates and deletes.
//! The plugin fails if anything outside was mounted, created or removed.

use super::{strict_object, Kit};
use crate::storage::environment;
use crate::storage::plugin::Operation;
use crate::volume::{VolumeRecord, VolumeSource};
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
        return kit.report.skip(
            RULE,
            "no parameter names an existing directory: nothing the kit can race (give the storage directory as a --param)",
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
    // Without the race: everything the kit made is deleted by the plugin.
    for rec in &vols {
        let env = environment::delete_env(&kit.node, rec);
        kit.call(Operation::Delete, &env).await;
    }
    let (mut notes, mut escapes) = result;
    if after != before {
        let gone: Vec<_> = before.difference(&after).take(5).collect();
        let new: Vec<_> = after.difference(&before).take(5).collect();
        escapes.push(format!(
            "outside the roots, removed {gone:?} and created {new:?}"
        ));
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
