//! Conformance rules for the optional storage operations (snapshots, clones, expand, fencing; checked
//! only when the fingerprint declares them), for JSON input parsing, and for path confinement
//! to the node's storage roots.

use super::{strict_object, Kit};
use crate::cluster::expansion;
use crate::cluster::snapshot::{self, SnapshotRecord};
use crate::storage::environment;
use crate::storage::plugin::{
    Capability, ExpandResult, Operation, SnapshotListResult, SnapshotResult, FENCE_TIMEOUT,
};
use crate::volume::{VolumeRecord, VolumeSource, VolumeState};
use std::path::{Path, PathBuf};

/// Reads the fingerprint's `capabilities` into the kit and reports them.
pub(super) fn capabilities_rule(kit: &mut Kit, fp: &serde_json::Value) {
    let rule = "capabilities";
    match fp.get("capabilities") {
        None => kit.report.push(
            rule,
            true,
            "declares no optional operations (snapshot, clone, expand are refused cleanly)",
        ),
        Some(serde_json::Value::Array(items)) if items.iter().all(|i| i.is_string()) => {
            let names: Vec<String> = items
                .iter()
                .filter_map(|i| i.as_str().map(String::from))
                .collect();
            let unknown: Vec<&String> = names
                .iter()
                .filter(|n| !Capability::ALL.iter().any(|c| c.as_str() == n.as_str()))
                .collect();
            let expand_online_alone =
                names.iter().any(|n| n == "expand_online") && !names.iter().any(|n| n == "expand");
            kit.report.push(
                rule,
                !expand_online_alone,
                if expand_online_alone {
                    "\"expand_online\" is declared without \"expand\"".to_string()
                } else if unknown.is_empty() {
                    format!("declares {names:?}")
                } else {
                    format!("declares {names:?}; unknown to this version and ignored: {unknown:?}")
                },
            );
            kit.capabilities = names;
        }
        Some(other) => kit.report.push(
            rule,
            false,
            format!("\"capabilities\" must be an array of strings, got {other}"),
        ),
    }
}

pub(super) fn has(kit: &Kit, cap: Capability) -> bool {
    kit.capabilities.iter().any(|c| c == cap.as_str())
}

/// The same JSON, written differently: pretty-printed over several lines, with every `/`
/// escaped as `\/`. A plugin that reads its input with a JSON parser sees no difference; one
/// that picks values out with sed or grep does.
fn reencode(json: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(v) => serde_json::to_string_pretty(&v)
            .unwrap_or_default()
            .replace('/', "\\/"),
        Err(_) => json.to_string(),
    }
}

/// `create` with its JSON variables re-encoded must answer as with the compact encoding.
pub(super) async fn json_input_rule(kit: &mut Kit) {
    let rule = "JSON input parsed";
    let env = environment::create_env(&kit.node, &kit.rec);
    let plain = kit.call(Operation::Create, &env).await;
    let odd: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| {
            if k == "DHV_PARAMETERS" || k == "DHV_SECRETS" {
                (k.clone(), reencode(v))
            } else {
                (k.clone(), v.clone())
            }
        })
        .collect();
    let other = kit.call(Operation::Create, &odd).await;
    let ctx = |c: &super::Call| {
        c.result
            .as_ref()
            .map_err(|e| e.report())
            .and_then(|o| strict_object(o))
            .map(|v| v.get("context").cloned().unwrap_or_default())
    };
    match (ctx(&plain), ctx(&other)) {
        (Ok(a), Ok(b)) if a == b => kit.report.push(
            rule,
            true,
            "create with DHV_PARAMETERS and DHV_SECRETS pretty-printed and '/' escaped as '\\/' gave the same context",
        ),
        (Ok(a), Ok(b)) => kit.report.push(
            rule,
            false,
            format!("the same input, re-encoded, gave another context: {a} vs {b} (read JSON with a JSON parser such as jq, not sed)"),
        ),
        (Err(e), _) => kit.report.push(rule, false, format!("create failed: {e}")),
        (_, Err(e)) => kit.report.push(
            rule,
            false,
            format!("create failed on the same input re-encoded (read JSON with a JSON parser such as jq, not sed): {e}"),
        ),
    }
}

/// With parameters `uid`, `gid` and/or `mode` given to the kit: the published volume's root
/// directory has that owner and mode (so a task running as that user can write to it).
pub(super) fn owner_rule(kit: &mut Kit, target: &Path) {
    use std::os::unix::fs::MetadataExt;
    let rule = "owner and mode";
    let p = &kit.rec.spec.parameters;
    let (uid, gid, mode) = (p.get("uid"), p.get("gid"), p.get("mode"));
    if uid.is_none() && gid.is_none() && mode.is_none() {
        kit.report.not_run(
            rule,
            "no --param uid=, gid= or mode= given to check (give the owner and mode the plugin sets, e.g. --param uid=65534 --param gid=65534 --param mode=0750)",
        );
        return;
    }
    let meta = match std::fs::metadata(target) {
        Ok(m) => m,
        Err(e) => {
            kit.report.push(
                rule,
                false,
                format!("cannot stat {}: {e}", target.display()),
            );
            return;
        }
    };
    let got = (meta.uid(), meta.gid(), meta.mode() & 0o7777);
    let want_mode = mode.and_then(|m| u32::from_str_radix(m, 8).ok());
    let ok = uid.is_none_or(|u| u.parse() == Ok(got.0))
        && gid.is_none_or(|g| g.parse() == Ok(got.1))
        && mode.is_none_or(|_| want_mode == Some(got.2));
    kit.report.push(
        rule,
        ok,
        format!(
            "asked uid {} gid {} mode {}; the published root is {}:{} {:04o}",
            uid.map_or("-", |s| s.as_str()),
            gid.map_or("-", |s| s.as_str()),
            mode.map_or("-", |s| s.as_str()),
            got.0,
            got.1,
            got.2
        ),
    );
}

/// Snapshot, create from snapshot, clone and expand, each when declared.
pub(super) async fn optional_rules(kit: &mut Kit) {
    let wants = |names: &[&str]| names.iter().any(|r| kit.report.wants(r));
    if has(kit, Capability::Snapshot) {
        if wants(&[
            "snapshot x2",
            "snapshot_list",
            "create from snapshot",
            "snapshot_delete x2",
        ]) {
            snapshot_rules(kit).await;
        }
    } else {
        for r in ["snapshot x2", "create from snapshot", "snapshot_delete x2"] {
            kit.report.skip(r, "\"snapshot\" not declared");
        }
    }
    if has(kit, Capability::Clone) {
        if kit.report.wants("clone") {
            clone_rule(kit).await;
        }
    } else {
        kit.report.skip("clone", "\"clone\" not declared");
    }
    if has(kit, Capability::Expand) {
        if kit.report.wants("expand") {
            expand_rule(kit).await;
        }
    } else {
        kit.report.skip("expand", "\"expand\" not declared");
    }
    if has(kit, Capability::Fence) {
        if ["fence", "fence x2", "fence of nothing"]
            .iter()
            .any(|r| kit.report.wants(r))
        {
            fence_rules(kit).await;
        }
    } else {
        for r in ["fence", "fence x2", "fence of nothing"] {
            kit.report.skip(
                r,
                "\"fence\" not declared (not offered: dhv-binder's own fence stands alone)",
            );
        }
    }
    if has(kit, Capability::Refresh) {
        if super::refresh::RULES.iter().any(|r| kit.report.wants(r)) {
            super::refresh::refresh_rules(kit).await;
        }
    } else {
        for r in super::refresh::RULES {
            kit.report.skip(
                r,
                "\"refresh\" not declared (a published mount keeps its credentials until published again)",
            );
        }
    }
    if has(kit, Capability::FenceNode) {
        if kit.report.wants("fence_node and unfence_node x2") {
            fence_node_rules(kit).await;
        }
    } else {
        kit.report.skip(
            "fence_node and unfence_node x2",
            "\"fence_node\" not declared (not offered: a take-over relies on the old node's own fence)",
        );
    }
}

/// A loopback TCP listener that never accepts: a connection to it opens (the kernel's
/// backlog) and is never answered, as a storage server behind a partition.
fn unanswering_listener() -> std::io::Result<std::net::TcpListener> {
    std::net::TcpListener::bind("127.0.0.1:0")
}

/// The volume's record with every parameter that is a URL pointed at `addr` (a listener that
/// never answers): a `fence` that goes over the network hangs and is killed at its deadline.
fn unreachable_storage(rec: &VolumeRecord, addr: std::net::SocketAddr) -> VolumeRecord {
    let mut rec = rec.clone();
    for v in rec.spec.parameters.values_mut() {
        if v.starts_with("http://") || v.starts_with("https://") {
            *v = format!("http://{addr}/");
        }
    }
    rec
}

/// Whether a new file can be made at `target`, bounded (a hung FUSE mount must not hang
/// the kit): `Ok(())` when it could, else how it failed.
async fn try_write(target: &Path) -> Result<(), String> {
    let file = target.join(format!("fence-{}", uuid::Uuid::new_v4()));
    let f = file.clone();
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(3),
        tokio::task::spawn_blocking(move || std::fs::write(&f, b"x")),
    )
    .await;
    match r {
        Ok(Ok(Ok(()))) => {
            let _ = std::fs::remove_file(&file);
            Ok(())
        }
        Ok(Ok(Err(e))) => Err(e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the write hung for 3 s".into()),
    }
}

/// `fence` (capability `fence`): on a published volume, with the storage unreachable (URL
/// parameters pointed at a listener that never answers), it succeeds within
/// [`FENCE_TIMEOUT`] and a write at the target fails afterwards; a second call succeeds
/// too; a fence of a target never published succeeds.
async fn fence_rules(kit: &mut Kit) {
    let target = kit.target("fence");
    let pctx = match kit.publish(&target, false).await {
        Ok(c) => c,
        Err(e) => {
            kit.report.push(
                "fence",
                false,
                format!("publish before the fence failed: {e}"),
            );
            return;
        }
    };
    let listener = unanswering_listener();
    let rec = match &listener {
        Ok(l) => match l.local_addr() {
            Ok(a) => unreachable_storage(&kit.rec, a),
            Err(_) => kit.rec.clone(),
        },
        Err(_) => kit.rec.clone(),
    };
    let env = kit.unpublish_env_of(&rec, &target, &pctx);
    let writable_before = try_write(&target).await;
    let c = kit.call_within(Operation::Fence, &env, FENCE_TIMEOUT).await;
    let after = try_write(&target).await;
    // A fence may end the mount itself (an aborted FUSE connection makes rclone exit and
    // unmount): a write then lands in the directory beneath, not in the volume (on a node,
    // that directory is dhv-binder's read-only placeholder). Unwritable means: the write
    // failed, or the target is no longer a mount point.
    let gone = after.is_ok() && !crate::node::mounts::is_mount_point(&target);
    let ok = c.ok() && writable_before.is_ok() && (after.is_err() || gone);
    kit.report.push(
        "fence",
        ok,
        match (&c.result, &writable_before, &after) {
            (Err(e), _, _) => format!(
                "fence with the storage unreachable failed in {} ms (it must not need the network, and finish within {FENCE_TIMEOUT:?}): {}",
                c.ms,
                e.report()
            ),
            (Ok(_), Err(e), _) => format!("the published volume was not writable before the fence: {e}"),
            (Ok(_), Ok(()), Ok(())) if gone => format!(
                "with the storage unreachable, fence took {} ms (limit {FENCE_TIMEOUT:?}); the mount then went away (the target is no longer a mount point)",
                c.ms
            ),
            (Ok(_), Ok(()), Ok(())) => format!("fence succeeded in {} ms but a new file could still be written at the target", c.ms),
            (Ok(_), Ok(()), Err(e)) => format!(
                "with the storage unreachable, fence took {} ms (limit {FENCE_TIMEOUT:?}); a write at the target then failed: {e}",
                c.ms
            ),
        },
    );
    let again = kit.call_within(Operation::Fence, &env, FENCE_TIMEOUT).await;
    kit.report.push(
        "fence x2",
        again.ok(),
        format!("fence of a volume already fenced: {}", again.describe()),
    );
    drop(listener);
    if let Err(e) = kit.unpublish(&target, &pctx).await {
        kit.report.push(
            "fence",
            false,
            format!("unpublish of the fenced volume failed (the fenced mount must still be released): {e}"),
        );
    }
    let never = kit.target("never-fenced");
    let env = kit.unpublish_env(&never, &serde_json::Value::Null);
    let c = kit.call_within(Operation::Fence, &env, FENCE_TIMEOUT).await;
    kit.report.push(
        "fence of nothing",
        c.ok(),
        format!("fence of a target never published: {}", c.describe()),
    );
}

/// `fence_node` / `unfence_node` (capability `fence_node`): each called twice for another
/// node succeeds both times, and this node still publishes and writes the volume between.
async fn fence_node_rules(kit: &mut Kit) {
    let rule = "fence_node and unfence_node x2";
    let mut env = environment::delete_env(&kit.node, &kit.rec);
    env.push((
        "DHV_FENCED_NODE_ID".into(),
        "00000000-0000-4000-8000-0000000000ff".into(),
    ));
    let mut notes = Vec::new();
    let mut ok = true;
    for op in [Operation::FenceNode, Operation::FenceNode] {
        let c = kit.call(op, &env).await;
        ok &= c.ok();
        notes.push(format!("{op}: {}", c.describe()));
    }
    let target = kit.target("fence-node");
    match kit.publish(&target, false).await {
        Ok(pctx) => {
            let w = try_write(&target).await;
            ok &= w.is_ok();
            notes.push(match w {
                Ok(()) => "this node published and wrote it".into(),
                Err(e) => format!("this node published it but cannot write it (fence_node of another node must leave this node alone): {e}"),
            });
            if let Err(e) = kit.unpublish(&target, &pctx).await {
                ok = false;
                notes.push(format!("unpublish failed: {e}"));
            }
        }
        Err(e) => {
            ok = false;
            notes.push(format!(
                "publish on this node after fencing another failed: {e}"
            ));
        }
    }
    for op in [Operation::UnfenceNode, Operation::UnfenceNode] {
        let c = kit.call(op, &env).await;
        ok &= c.ok();
        notes.push(format!("{op}: {}", c.describe()));
    }
    kit.report.push(rule, ok, notes.join("; "));
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A second test volume of the same plugin and parameters, starting from `source`.
pub(super) fn other_volume(kit: &Kit, name: &str, source: VolumeSource) -> VolumeRecord {
    let mut rec = kit.rec.clone();
    rec.id = uuid::Uuid::new_v4().to_string();
    rec.spec.name = name.into();
    rec.spec.source = source;
    rec.context = serde_json::Value::Null;
    rec
}

/// Creates `rec` twice with `extra` variables; returns its context when both calls agree.
async fn create_twice(
    kit: &mut Kit,
    rec: &VolumeRecord,
    extra: Vec<(String, String)>,
) -> Result<serde_json::Value, String> {
    let mut env = environment::create_env(&kit.node, rec);
    env.extend(extra);
    let mut ctxs = Vec::new();
    for _ in 0..2 {
        let c = kit.call(Operation::Create, &env).await;
        let out = c.result.map_err(|e| e.report())?;
        ctxs.push(
            strict_object(&out)?
                .get("context")
                .cloned()
                .unwrap_or_default(),
        );
    }
    if ctxs[0] != ctxs[1] {
        return Err(format!(
            "two creates gave different contexts: {} vs {}",
            ctxs[0], ctxs[1]
        ));
    }
    Ok(ctxs.remove(0))
}

/// Publishes `rec`, reads `file` from it, unpublishes, and deletes `rec`.
async fn read_through(
    kit: &mut Kit,
    rec: &VolumeRecord,
    target: &Path,
    files: &[&str],
) -> Result<Vec<Option<String>>, String> {
    let pctx = kit.publish_rec(rec, target, false).await?;
    let got = files
        .iter()
        .map(|f| std::fs::read_to_string(target.join(f)).ok())
        .collect();
    kit.unpublish_rec(rec, target, &pctx).await?;
    let denv = environment::delete_env(&kit.node, rec);
    kit.call(Operation::Delete, &denv)
        .await
        .result
        .map_err(|e| format!("delete of the new volume: {}", e.report()))?;
    Ok(got)
}

async fn snapshot_rules(kit: &mut Kit) {
    let src = kit.target("snapshot-source");
    let mut snap = SnapshotRecord::new(&kit.rec, "conformance", now());
    // Snapshot a published volume with a writer's file in it, twice (idempotent).
    let taken: Result<serde_json::Value, String> = async {
        let pctx = kit.publish(&src, false).await?;
        std::fs::write(src.join("kit-snapshot"), "before").map_err(|e| e.to_string())?;
        let env = snapshot::create_env(&kit.node, &kit.rec, &snap, Some(&src));
        let mut ctxs = Vec::new();
        for _ in 0..2 {
            let c = kit.call(Operation::SnapshotCreate, &env).await;
            let out = c.result.map_err(|e| e.report())?;
            let res: SnapshotResult = serde_json::from_value(strict_object(&out)?)
                .map_err(|e| format!("not {{\"bytes\",\"context\"}}: {e}"))?;
            ctxs.push(res.context);
        }
        // Writes after the snapshot must not reach it.
        std::fs::write(src.join("kit-snapshot"), "after").map_err(|e| e.to_string())?;
        std::fs::write(src.join("kit-later"), "later").map_err(|e| e.to_string())?;
        kit.unpublish(&src, &pctx).await?;
        if ctxs[0] != ctxs[1] {
            return Err(format!(
                "two snapshot_create calls with one DHV_SNAPSHOT_ID gave different contexts: {} vs {}",
                ctxs[0], ctxs[1]
            ));
        }
        Ok(ctxs.remove(0))
    }
    .await;
    let ctx = match taken {
        Ok(c) => {
            kit.report.push(
                "snapshot x2",
                true,
                format!("snapshot of a published volume, twice with one ID: same context {c}"),
            );
            c
        }
        Err(e) => {
            kit.report.push("snapshot x2", false, e);
            kit.report.skip("create from snapshot", "no snapshot");
            kit.report.skip("snapshot_delete x2", "no snapshot");
            return;
        }
    };
    snap.context = ctx;
    snap.state = VolumeState::Ready;

    if has(kit, Capability::SnapshotList) {
        let env = snapshot::list_env(&kit.node, &kit.rec.secrets);
        let c = kit.call(Operation::SnapshotList, &env).await;
        let listed = c
            .result
            .as_ref()
            .map_err(|e| e.report())
            .and_then(|o| strict_object(o))
            .and_then(|v| {
                serde_json::from_value::<SnapshotListResult>(v).map_err(|e| e.to_string())
            });
        kit.report.push(
            "snapshot_list",
            matches!(&listed, Ok(l) if l.snapshots.iter().any(|s| s.id == snap.id)),
            match &listed {
                Ok(l) => format!(
                    "{} snapshot(s) listed, the new one {}",
                    l.snapshots.len(),
                    if l.snapshots.iter().any(|s| s.id == snap.id) {
                        "among them"
                    } else {
                        "MISSING"
                    }
                ),
                Err(e) => e.clone(),
            },
        );
    }

    // A new volume from the snapshot holds what was there at snapshot time, nothing later.
    let rec = other_volume(
        kit,
        "conformance-from-snapshot",
        VolumeSource::SnapshotId(snap.id.clone()),
    );
    let restored: Result<Vec<Option<String>>, String> = async {
        let extra =
            snapshot::source_env(&rec, Some(&snap), None, None).map_err(|e| e.to_string())?;
        let mut rec = rec.clone();
        rec.context = create_twice(kit, &rec, extra).await?;
        read_through(
            kit,
            &rec,
            &kit.target("from-snapshot"),
            &["kit-snapshot", "kit-later"],
        )
        .await
    }
    .await;
    kit.report.push(
        "create from snapshot",
        matches!(&restored, Ok(v) if v[0].as_deref() == Some("before") && v[1].is_none()),
        match &restored {
            Ok(v) => format!(
                "written \"before\", snapshot, then \"after\" and a new file: the new volume has {:?} and the new file {}",
                v[0],
                if v[1].is_none() { "absent (the snapshot is unchanged by later writes)" } else { "PRESENT" }
            ),
            Err(e) => e.clone(),
        },
    );

    // snapshot_delete twice, then of a snapshot never made.
    let env = snapshot::delete_env(&kit.node, &snap);
    let a = kit.call(Operation::SnapshotDelete, &env).await;
    let b = kit.call(Operation::SnapshotDelete, &env).await;
    let mut ghost = snap.clone();
    ghost.id = uuid::Uuid::new_v4().to_string();
    ghost.context = serde_json::Value::Null;
    let genv = snapshot::delete_env(&kit.node, &ghost);
    let g = kit.call(Operation::SnapshotDelete, &genv).await;
    kit.report.push(
        "snapshot_delete x2",
        a.ok() && b.ok() && g.ok(),
        format!(
            "first: {}; second: {}; of a snapshot never made (context null): {}",
            a.describe(),
            b.describe(),
            g.describe()
        ),
    );
}

async fn clone_rule(kit: &mut Kit) {
    let src = kit.target("clone-source");
    let rec = other_volume(
        kit,
        "conformance-clone",
        VolumeSource::CloneId(kit.rec.spec.name.clone()),
    );
    let got: Result<Vec<Option<String>>, String> = async {
        let pctx = kit.publish(&src, false).await?;
        std::fs::write(src.join("kit-clone"), "source").map_err(|e| e.to_string())?;
        let extra = snapshot::source_env(&rec, None, Some(&kit.rec.clone()), Some(&src))
            .map_err(|e| e.to_string())?;
        let mut rec = rec.clone();
        let made = create_twice(kit, &rec, extra).await;
        std::fs::write(src.join("kit-clone"), "changed after the clone")
            .map_err(|e| e.to_string())?;
        kit.unpublish(&src, &pctx).await?;
        rec.context = made?;
        read_through(kit, &rec, &kit.target("clone"), &["kit-clone"]).await
    }
    .await;
    kit.report.push(
        "clone",
        matches!(&got, Ok(v) if v[0].as_deref() == Some("source")),
        match &got {
            Ok(v) => format!("clone of a published volume (twice, same context) holds {:?}, written before the clone", v[0]),
            Err(e) => e.clone(),
        },
    );
}

fn fs_bytes(p: &Path) -> Result<u64, String> {
    let s = nix::sys::statvfs::statvfs(p).map_err(|e| format!("statvfs {}: {e}", p.display()))?;
    Ok(s.blocks() as u64 * s.fragment_size() as u64)
}

async fn expand_rule(kit: &mut Kit) {
    let online = has(kit, Capability::ExpandOnline);
    let t = kit.target("expand");
    let to = kit
        .rec
        .spec
        .capacity_min
        .max(kit.rec.capacity_bytes)
        .max(kit.opts.capacity)
        * 2;
    let mut pctx = serde_json::Value::Null;
    let outcome: Result<String, String> = async {
        pctx = kit.publish(&t, false).await?;
        std::fs::write(t.join("kit-expand"), "kept").map_err(|e| e.to_string())?;
        let before = fs_bytes(&t)?;
        if !online {
            kit.unpublish(&t, &pctx).await?;
        }
        let env = expansion::expand_env(&kit.node, &kit.rec, to, online.then_some(t.as_path()));
        let mut sizes = Vec::new();
        for _ in 0..2 {
            let c = kit.call(Operation::Expand, &env).await;
            let out = c.result.map_err(|e| e.report())?;
            let res: ExpandResult = serde_json::from_value(strict_object(&out)?)
                .map_err(|e| format!("not {{\"bytes\"}}: {e}"))?;
            sizes.push(res.bytes);
        }
        if !online {
            pctx = kit.publish(&t, false).await?;
        }
        let after = fs_bytes(&t)?;
        let kept = std::fs::read_to_string(t.join("kit-expand")).ok();
        kit.unpublish(&t, &pctx).await?;
        let note = format!(
            "{} expand to {to} bytes (twice): plugin said {sizes:?}; filesystem {before} → {after} bytes; data {}",
            if online { "online" } else { "offline" },
            if kept.as_deref() == Some("kept") { "intact" } else { "LOST" }
        );
        if kept.as_deref() != Some("kept") || after <= before || sizes.iter().any(|s| *s < to) {
            return Err(note);
        }
        Ok(note)
    }
    .await;
    if outcome.is_err() && crate::node::mounts::is_mount_point(&t) {
        let _ = kit.unpublish(&t, &pctx).await;
    }
    if outcome.is_ok() {
        kit.rec.spec.capacity_min = to;
    }
    let ok = outcome.is_ok();
    kit.report.push("expand", ok, outcome.unwrap_or_else(|e| e));
}

/// Replaces every absolute path in `v` with the victim of the same kind (`<name>.img` file or
/// `<name>` dir, named like the volume's own storage) under `base` (the outside directory,
/// reached directly, through `..` or a symlink).
fn plant(v: &serde_json::Value, base: &Path, name: &str) -> (serde_json::Value, usize) {
    match v {
        serde_json::Value::String(s) if s.starts_with('/') => {
            let kind = if s.ends_with(".img") {
                format!("{name}.img")
            } else {
                name.to_string()
            };
            (
                serde_json::Value::String(base.join(kind).display().to_string()),
                1,
            )
        }
        serde_json::Value::Object(m) => {
            let mut n = 0;
            let out = m
                .iter()
                .map(|(k, x)| {
                    let (y, c) = plant(x, base, name);
                    n += c;
                    (k.clone(), y)
                })
                .collect();
            (serde_json::Value::Object(out), n)
        }
        other => (other.clone(), 0),
    }
}

/// The victims' state: the directory's listing and file, and the image file's bytes.
fn victims(outside: &Path, name: &str) -> String {
    let mut s = String::new();
    for p in [outside.join(name), outside.to_path_buf()] {
        let mut names: Vec<String> = std::fs::read_dir(&p)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        s.push_str(&format!("{}: {names:?}; ", p.display()));
    }
    s.push_str(&std::fs::read_to_string(outside.join(name).join("precious")).unwrap_or_default());
    s.push_str(&std::fs::read_to_string(outside.join(format!("{name}.img"))).unwrap_or_default());
    s
}

/// A volume record or parameters pointing outside the node's storage roots (directly, with
/// `..`, or through a symlink inside a root) must be refused: nothing mounted, nothing
/// created, changed or deleted outside.
pub(super) async fn confinement_rule(kit: &mut Kit) {
    let rule = "paths confined";
    let outside = kit.scratch.join("outside");
    let link = kit.node.volumes_dir.join("kit-escape");
    // Victims named like the volume's own storage (its ID): only the roots can refuse them.
    let name = kit.rec.id.clone();
    let prepared = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(outside.join(&name))?;
        std::fs::write(outside.join(&name).join("precious"), "precious")?;
        std::fs::write(outside.join(format!("{name}.img")), "precious image")?;
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&outside, &link)
    })();
    if let Err(e) = prepared {
        kit.report
            .push(rule, false, format!("cannot prepare the victims: {e}"));
        return;
    }
    let before = victims(&outside, &name);
    // The victims reached directly, through a '..' detour, and through a symlink in a root.
    let escapes = [
        ("outside the roots", outside.clone()),
        (
            "through '..'",
            PathBuf::from(format!("{}/../outside", kit.node.volumes_dir.display())),
        ),
        ("through a symlink in a root", link.clone()),
    ];
    let mut notes = Vec::new();
    let mut ok = true;
    let mut planted_any = false;
    for (how, base) in &escapes {
        // A planted create context: publish must fail with nothing mounted; delete (and
        // expand, snapshot_create when declared) must leave the victims alone.
        let (ctx, n) = plant(&kit.rec.context, base, &name);
        if n > 0 {
            planted_any = true;
            let mut bad = kit.rec.clone();
            bad.context = ctx;
            let t = kit.target("planted");
            let _ = std::fs::create_dir_all(&t);
            let penv = kit.publish_env_of(&bad, &t, false);
            let p = kit.call(Operation::Publish, &penv).await;
            let mounted = crate::node::mounts::is_mount_point(&t);
            if mounted {
                let _ = nix::mount::umount2(&t, nix::mount::MntFlags::MNT_DETACH);
            }
            let denv = environment::delete_env(&kit.node, &bad);
            let d = kit.call(Operation::Delete, &denv).await;
            if has(kit, Capability::Expand) {
                let env = expansion::expand_env(&kit.node, &bad, kit.opts.capacity * 4, None);
                kit.call(Operation::Expand, &env).await;
            }
            if has(kit, Capability::Snapshot) {
                let snap = SnapshotRecord::new(&bad, "planted", now());
                let env = snapshot::create_env(&kit.node, &bad, &snap, None);
                kit.call(Operation::SnapshotCreate, &env).await;
            }
            let intact = victims(&outside, &name) == before;
            ok &= !p.ok() && !mounted && intact;
            notes.push(format!(
                "context {how}: publish {}{}, delete {}, victims {}",
                if p.ok() { "SUCCEEDED" } else { "refused" },
                if mounted { " and MOUNTED" } else { "" },
                if d.ok() { "ok" } else { "refused" },
                if intact { "intact" } else { "CHANGED" }
            ));
        }
        // Planted parameters: create must not make anything outside.
        let params = serde_json::to_value(&kit.rec.spec.parameters).unwrap_or_default();
        let (planted, n) = plant(&params, base, &name);
        if n > 0 {
            planted_any = true;
            let mut bad = other_volume(kit, "conformance-planted", VolumeSource::Empty);
            bad.spec.parameters = serde_json::from_value(planted).unwrap_or_default();
            let env = environment::create_env(&kit.node, &bad);
            let c = kit.call(Operation::Create, &env).await;
            let intact = victims(&outside, &name) == before;
            ok &= !c.ok() && intact;
            notes.push(format!(
                "parameters {how}: create {}, victims {}",
                if c.ok() { "SUCCEEDED" } else { "refused" },
                if intact { "intact" } else { "CHANGED" }
            ));
        }
    }
    let _ = std::fs::remove_file(&link);
    if planted_any {
        kit.report.push(rule, ok, notes.join("; "));
    } else {
        kit.report.not_run(
            rule,
            "neither the create context nor the parameters name a path (give the storage directory as --param KEY=/dir)",
        );
    }
}
