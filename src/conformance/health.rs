//! Conformance rules for the operations that tell how a volume is (`stats`, `health`,
//! `list`; checked only when the fingerprint declares them) and for "never format what
//! holds anything" (docs/plugin-protocol.md, "stats and health", "list", "Check before
//! trust").

use super::storage::{has, other_volume};
use super::{strict_object, Kit};
use crate::storage::environment;
use crate::storage::plugin::{Capability, Operation};
use crate::storage::volume_health::{HealthResult, ListResult, StatsResult};
use crate::volume::VolumeSource;
use std::path::{Path, PathBuf};

/// Bytes the `stats` rule writes into the volume between its two calls.
const STATS_WRITE: usize = 1 << 20;

/// The agent's bound on one `stats` or `health` call.
const CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The rules of this module, run where they apply.
pub(super) async fn rules(kit: &mut Kit) {
    if (has(kit, Capability::Stats) || has(kit, Capability::Health))
        && ["stats", "health"].iter().any(|r| kit.report.wants(r))
    {
        stats_and_health_rules(kit).await;
    }
    if !has(kit, Capability::Stats) {
        kit.report.skip(
            "stats",
            "\"stats\" not declared (the mount's statfs stands for the volume's usage)",
        );
    }
    if !has(kit, Capability::Health) {
        kit.report.skip("health", "\"health\" not declared");
    }
    if has(kit, Capability::List) {
        if kit.report.wants("list") {
            list_rule(kit).await;
        }
    } else {
        kit.report.skip("list", "\"list\" not declared");
    }
    if kit.report.wants("foreign signature refused") {
        foreign_signature_rule(kit).await;
    }
    if kit.report.wants("unclean filesystem checked") {
        unclean_check_rule(kit).await;
    }
}

/// `stats` (capability `stats`): on a published volume, twice, a sound answer within the
/// agent's 10 s, `used` grown by at least the 1 MiB written between the calls. `health`
/// (capability `health`): on the same fresh volume, twice, `{"abnormal":false}` within 10 s.
async fn stats_and_health_rules(kit: &mut Kit) {
    let target = kit.target("stats");
    let pctx = match kit.publish(&target, false).await {
        Ok(c) => c,
        Err(e) => {
            for r in ["stats", "health"] {
                if has(kit, cap_of(r)) {
                    kit.report
                        .push(r, false, format!("publish before the call failed: {e}"));
                }
            }
            return;
        }
    };
    let env = kit.unpublish_env(&target, &pctx);
    if has(kit, Capability::Stats) {
        let first = stats(kit, &env).await;
        let wrote = write_and_sync(&target.join("kit-stats"), STATS_WRITE);
        let second = stats(kit, &env).await;
        let (ok, evidence) = match (first, wrote, second) {
            (Err(e), _, _) | (_, _, Err(e)) => (false, e),
            (_, Err(e), _) => (
                false,
                format!("cannot write into the published volume: {e}"),
            ),
            (Ok(a), Ok(()), Ok(b)) => {
                let grew = b.used_bytes.saturating_sub(a.used_bytes);
                (
                    grew >= STATS_WRITE as u64,
                    format!(
                        "used {} → {} bytes after {STATS_WRITE} were written (capacity {}, available {}; inodes {} used of {})",
                        a.used_bytes, b.used_bytes, b.capacity_bytes, b.available_bytes, b.inodes_used, b.inodes
                    ),
                )
            }
        };
        kit.report.push("stats", ok, evidence);
        let _ = std::fs::remove_file(target.join("kit-stats"));
    }
    if has(kit, Capability::Health) {
        let mut answers = Vec::new();
        for _ in 0..2 {
            let c = kit
                .call_within(Operation::Health, &env, CHECK_TIMEOUT)
                .await;
            answers.push(match c.result {
                Err(e) => Err(format!("health failed in {} ms: {}", c.ms, e.report())),
                Ok(out) => serde_json::from_slice::<HealthResult>(&out)
                    .map_err(|e| format!("health printed no {{\"abnormal\":…}}: {e}"))
                    .and_then(|h| h.condition().map_err(|e| e.to_string()))
                    .map(|cond| (cond, c.ms)),
            });
        }
        let ok = answers
            .iter()
            .all(|a| matches!(a, Ok((c, _)) if !c.abnormal));
        let evidence = answers
            .iter()
            .map(|a| match a {
                Ok((c, ms)) if !c.abnormal => format!("healthy in {ms} ms"),
                Ok((c, _)) => format!("a fresh volume said {}: {}", c.word(), c.message),
                Err(e) => e.clone(),
            })
            .collect::<Vec<_>>()
            .join("; ");
        kit.report.push("health", ok, evidence);
    }
    if let Err(e) = kit.unpublish(&target, &pctx).await {
        kit.report.push(
            if has(kit, Capability::Stats) {
                "stats"
            } else {
                "health"
            },
            false,
            format!("unpublish after the calls failed: {e}"),
        );
    }
}

fn cap_of(rule: &str) -> Capability {
    if rule == "stats" {
        Capability::Stats
    } else {
        Capability::Health
    }
}

/// One `stats` call, bounded as the agent bounds it, and its figures.
async fn stats(
    kit: &mut Kit,
    env: &[(String, String)],
) -> Result<crate::node::usage::Usage, String> {
    let c = kit.call_within(Operation::Stats, env, CHECK_TIMEOUT).await;
    let out = c
        .result
        .map_err(|e| format!("stats failed in {} ms: {}", c.ms, e.report()))?;
    serde_json::from_slice::<StatsResult>(&out)
        .map_err(|e| format!("stats printed no {{\"usage\":[…]}} in CSI's shape: {e}"))?
        .usage()
        .map_err(|e| e.to_string())
}

/// Writes `n` bytes to `path` and syncs them (so the blocks are allocated when counted).
fn write_and_sync(path: &Path, n: usize) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| e.to_string())?;
    f.write_all(&vec![0x5a; n]).map_err(|e| e.to_string())?;
    f.sync_all().map_err(|e| e.to_string())
}

/// `list` (capability `list`): with the volume's parameters, names the kit's volume (made
/// by `create`) and, once a second volume is created and deleted, not that one.
async fn list_rule(kit: &mut Kit) {
    let rule = "list";
    let other = other_volume(kit, "conformance-list", VolumeSource::Empty);
    let r: Result<String, String> = async {
        let env = environment::create_env(&kit.node, &other);
        let made = kit.call(Operation::Create, &env).await;
        let ctx = strict_object(&made.result.map_err(|e| e.report())?)?
            .get("context")
            .cloned()
            .unwrap_or_default();
        let with_both = listed(kit).await?;
        let mut other = other.clone();
        other.context = ctx;
        let denv = environment::delete_env(&kit.node, &other);
        kit.call(Operation::Delete, &denv)
            .await
            .result
            .map_err(|e| format!("delete of the second volume: {}", e.report()))?;
        let after = listed(kit).await?;
        let (kit_id, other_id) = (&kit.rec.id, &other.id);
        match (
            with_both.contains(kit_id),
            with_both.contains(other_id),
            after.contains(other_id),
        ) {
            (true, true, false) => Ok(format!(
                "lists the kit's volumes ({} entries), and no longer the deleted one",
                with_both.len()
            )),
            (false, _, _) => Err(format!("the kit's volume {kit_id} is not listed")),
            (_, false, _) => Err(format!("a volume just created ({other_id}) is not listed")),
            (_, _, true) => Err(format!("a deleted volume ({other_id}) is still listed")),
        }
    }
    .await;
    kit.report.push(rule, r.is_ok(), r.unwrap_or_else(|e| e));
}

/// `list` with the kit's volume's parameters and secrets: the IDs it names.
async fn listed(kit: &mut Kit) -> Result<std::collections::BTreeSet<String>, String> {
    let mut env = environment::node_env(&kit.node);
    let params = serde_json::to_string(&kit.rec.spec.parameters).unwrap_or_default();
    env.push(("DHV_PARAMETERS".into(), params));
    environment::set_secrets(&mut env, &kit.rec.secrets);
    let c = kit.call(Operation::List, &env).await;
    let out = c.result.map_err(|e| e.report())?;
    strict_object(&out)?;
    let l: ListResult = serde_json::from_slice(&out)
        .map_err(|e| format!("list printed no {{\"volumes\":[…]}}: {e}"))?;
    l.ids().map_err(|e| e.to_string())
}

/// The regular file a volume's context names, when its storage is one the kit can reach
/// (an image file): the first absolute path among the context's string values that is a
/// regular file under one of the kit's storage roots (the kit writes into it: never a file
/// elsewhere, whatever a context says).
fn storage_file(kit: &Kit, ctx: &serde_json::Value) -> Option<PathBuf> {
    let roots: Vec<PathBuf> = kit
        .allowed
        .get(&kit.plugin_id)
        .map(|r| {
            r.split(':')
                .filter(|r| !r.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default();
    ctx.as_object()?
        .values()
        .filter_map(|v| v.as_str())
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file()))
        .find(|p| {
            p.canonicalize()
                .is_ok_and(|c| roots.iter().any(|r| c.starts_with(r) && c != *r))
        })
}

/// A DOS partition table (one Linux partition) over zeros: a signature and no filesystem.
fn foreign_head() -> Vec<u8> {
    let mut head = vec![0u8; 64 << 10];
    let mut entry = vec![0u8, 0, 0, 0, 0x83, 0, 0, 0];
    entry.extend(2048u32.to_le_bytes());
    entry.extend(16384u32.to_le_bytes());
    head[446..446 + entry.len()].copy_from_slice(&entry);
    head[510] = 0x55;
    head[511] = 0xaa;
    head
}

/// Never format what holds anything: a new volume whose storage file (named by its
/// context) is given a partition table and no filesystem before its first publish must be
/// refused, nothing mounted, the file unchanged. Not run when the context names no file.
async fn foreign_signature_rule(kit: &mut Kit) {
    let rule = "foreign signature refused";
    let mut rec = other_volume(kit, "conformance-foreign", VolumeSource::Empty);
    let env = environment::create_env(&kit.node, &rec);
    let made = kit.call(Operation::Create, &env).await;
    let ctx = match made
        .result
        .map_err(|e| e.report())
        .and_then(|o| strict_object(&o))
    {
        Ok(v) => v.get("context").cloned().unwrap_or_default(),
        Err(e) => {
            kit.report.push(rule, false, format!("create failed: {e}"));
            return;
        }
    };
    rec.context = ctx.clone();
    let Some(file) = storage_file(kit, &ctx) else {
        kit.report.skip(
            rule,
            "the context names no storage file under the storage roots (a directory, a remote): not run",
        );
        let denv = environment::delete_env(&kit.node, &rec);
        kit.call(Operation::Delete, &denv).await;
        return;
    };
    let r: Result<String, String> = async {
        let head = foreign_head();
        {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(&file)
                .map_err(|e| format!("cannot open {}: {e}", file.display()))?;
            f.write_all(&head).map_err(|e| e.to_string())?;
            f.sync_all().map_err(|e| e.to_string())?;
        }
        let before = std::fs::read(&file).map_err(|e| e.to_string())?;
        let target = kit.target("foreign");
        std::fs::create_dir_all(&target).map_err(|e| e.to_string())?;
        let penv = kit.publish_env_of(&rec, &target, false);
        let c = kit.call(Operation::Publish, &penv).await;
        let mounted = crate::node::mounts::is_mount_point(&target);
        if mounted {
            let pctx = c
                .result
                .as_ref()
                .ok()
                .and_then(|o| strict_object(o).ok())
                .and_then(|v| v.get("context").cloned())
                .unwrap_or_default();
            let _ = kit.unpublish_rec(&rec, &target, &pctx).await;
        }
        let after = std::fs::read(&file).map_err(|e| e.to_string())?;
        match (&c.result, mounted, before == after) {
            (Err(e), false, true) => Ok(format!(
                "a storage file with a partition table and no filesystem: publish refused ({}); nothing mounted, the file unchanged",
                e.report()
            )),
            (Ok(_), _, _) => Err(format!(
                "publish succeeded on a storage file that carries a partition table ({}): it must be refused, never formatted",
                file.display()
            )),
            (Err(_), true, _) => Err("publish failed but left the target mounted".into()),
            (Err(_), false, false) => Err(format!(
                "publish failed but wrote to the storage file {} (it must be left as it was)",
                file.display()
            )),
        }
    }
    .await;
    kit.report.push(rule, r.is_ok(), r.unwrap_or_else(|e| e));
    let denv = environment::delete_env(&kit.node, &rec);
    kit.call(Operation::Delete, &denv).await;
}

/// The ext2/3/4 superblock's `s_lastcheck` (Unix seconds of the last full check) of the
/// filesystem in `file`; `None` when it holds none (no magic 0xEF53 at byte 1080).
fn ext_last_check(file: &Path) -> Option<u32> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(file).ok()?;
    let mut sb = [0u8; 68];
    f.seek(SeekFrom::Start(1024)).ok()?;
    f.read_exact(&mut sb).ok()?;
    (sb[56..58] == [0x53, 0xef]).then(|| u32::from_le_bytes([sb[64], sb[65], sb[66], sb[67]]))
}

/// Check before trust: a new volume, published once (formatted) with a file written and
/// unpublished, has its ext filesystem marked unclean (`debugfs -w -R "ssv state 0"`, as a
/// node that died with it mounted leaves it); the next publish must check it first (its
/// superblock's "last checked" moves) and the file must still be there. SKIP when the
/// storage is no file holding an ext2/3/4 filesystem; not run without `debugfs`.
async fn unclean_check_rule(kit: &mut Kit) {
    let rule = "unclean filesystem checked";
    let mut rec = other_volume(kit, "conformance-unclean", VolumeSource::Empty);
    let env = environment::create_env(&kit.node, &rec);
    let made = kit.call(Operation::Create, &env).await;
    match made
        .result
        .map_err(|e| e.report())
        .and_then(|o| strict_object(&o))
    {
        Ok(v) => rec.context = v.get("context").cloned().unwrap_or_default(),
        Err(e) => {
            kit.report.push(rule, false, format!("create failed: {e}"));
            return;
        }
    }
    let target = kit.target("unclean");
    let r: Result<Option<String>, String> = async {
        let Some(file) = storage_file(kit, &rec.context) else {
            return Ok(None);
        };
        let pctx = kit.publish_rec(&rec, &target, false).await?;
        std::fs::write(target.join("kit-unclean"), "kept").map_err(|e| e.to_string())?;
        kit.unpublish_rec(&rec, &target, &pctx).await?;
        let Some(before) = ext_last_check(&file) else {
            return Ok(None);
        };
        // "Last checked" has a resolution of one second.
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        // Where e2fsprogs installs it (the kit may run with an empty environment).
        let marked = tokio::process::Command::new("debugfs")
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .args(["-w", "-R", "ssv state 0"])
            .arg(&file)
            .output()
            .await
            .map_err(|e| format!("cannot run debugfs: {e}"))?;
        if !marked.status.success() {
            return Err(format!(
                "cannot run debugfs: {}",
                String::from_utf8_lossy(&marked.stderr).trim()
            ));
        }
        let pctx = kit.publish_rec(&rec, &target, false).await?;
        let kept = std::fs::read_to_string(target.join("kit-unclean")).ok();
        kit.unpublish_rec(&rec, &target, &pctx).await?;
        let after = ext_last_check(&file);
        match (after, kept.as_deref()) {
            (Some(a), Some("kept")) if a != before => Ok(Some(format!(
                "the filesystem marked unclean was checked before its publish (last checked {before} → {a}) and the file written before is there"
            ))),
            (_, Some("kept")) => Err(format!(
                "the filesystem marked unclean was mounted unchecked (last checked stayed {before}): check it (e2fsck -p) before a read-write mount"
            )),
            _ => Err("the file written before the unclean mark is gone after the publish".into()),
        }
    }
    .await;
    match r {
        Ok(Some(evidence)) => kit.report.push(rule, true, evidence),
        Ok(None) => kit.report.skip(
            rule,
            "the storage is no file holding an ext2/3/4 filesystem the kit can mark unclean",
        ),
        Err(e) if e.starts_with("cannot run debugfs") => kit.report.not_run(rule, &e),
        Err(e) => kit.report.push(rule, false, e),
    }
    let denv = environment::delete_env(&kit.node, &rec);
    kit.call(Operation::Delete, &denv).await;
}
