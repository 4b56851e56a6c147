//! The kit's rules for `refresh` (capability `refresh`; docs/plugin-protocol.md "refresh"):
//!
//! - `refresh`: on a published volume, two `refresh` calls with the volume's secrets succeed,
//!   the target stays the very same mount (its mount ID in the kernel's table: a refresh
//!   must not unmount or mount again, the tasks' binds would be left on the old one), a file
//!   written before is read back through it, and a new one is written after;
//! - `refresh of nothing`: a refresh of a target never published succeeds (the agent may
//!   call it while an unpublish has just ended).
//!
//! What the storage then accepts (the new credential, the old one refused) the kit cannot
//! know: the plugin's own end-to-end tests show it (for `webdav`, `tests/secrets.rs`).

use super::Kit;
use crate::node::mounts::MountTable;
use crate::storage::plugin::Operation;
use std::path::Path;

/// The rules' names, in the kit's order.
pub(super) const RULES: [&str; 2] = ["refresh", "refresh of nothing"];

/// The topmost mount at `target` in the kernel's table, if any: its mount ID, device,
/// type and source (an ID alone can be reused by the next mount once one is gone).
fn mount_id(target: &Path) -> Option<String> {
    let table = MountTable::read().ok()?;
    let m = table.at(target).last()?;
    Some(format!(
        "{} ({}:{}, {} {})",
        m.id,
        m.dev.major,
        m.dev.minor,
        m.fs_type(),
        m.source()
    ))
}

/// Reads `path` on a thread of its own, bounded (a hung FUSE mount must not hang the kit).
async fn read_bounded(path: &Path) -> Result<String, String> {
    let p = path.to_path_buf();
    match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::task::spawn_blocking(move || std::fs::read_to_string(p)),
    )
    .await
    {
        Ok(Ok(r)) => r.map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the read hung for 10 s".into()),
    }
}

/// Writes `text` to `path`, bounded as [`read_bounded`].
async fn write_bounded(path: &Path, text: &'static str) -> Result<(), String> {
    let p = path.to_path_buf();
    match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::task::spawn_blocking(move || std::fs::write(p, text)),
    )
    .await
    {
        Ok(Ok(r)) => r.map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the write hung for 10 s".into()),
    }
}

/// Runs both rules.
pub(super) async fn refresh_rules(kit: &mut Kit) {
    let target = kit.target("refresh");
    let pctx = match kit.publish(&target, false).await {
        Ok(c) => c,
        Err(e) => {
            kit.report.push(
                "refresh",
                false,
                format!("publish before the refresh failed: {e}"),
            );
            return;
        }
    };
    let before = mount_id(&target);
    let wrote = write_bounded(&target.join("before-refresh"), "before").await;
    let env = kit.unpublish_env(&target, &pctx);
    let one = kit.call(Operation::Refresh, &env).await;
    let two = kit.call(Operation::Refresh, &env).await;
    let after = mount_id(&target);
    let read = read_bounded(&target.join("before-refresh")).await;
    let wrote_after = write_bounded(&target.join("after-refresh"), "after").await;
    let evidence = if !one.ok() || !two.ok() {
        format!(
            "refresh of a published volume: {}; again: {}",
            one.describe(),
            two.describe()
        )
    } else if before.is_none() || before != after {
        format!(
            "the target's mount changed across the refresh ({before:?} before, {after:?} after): a refresh must apply the credentials to the mount in place, not mount again"
        )
    } else if let Err(e) = wrote.and(read.and_then(|t| {
        (t == "before")
            .then_some(())
            .ok_or_else(|| format!("read back {t:?}, not \"before\""))
    })) {
        format!("a file written before the refresh could not be read back after it: {e}")
    } else if let Err(e) = wrote_after {
        format!("a file could not be written after the refresh: {e}")
    } else {
        format!(
            "refresh x2 in {} and {} ms; the same mount (ID {}) served a file written before and one written after",
            one.ms,
            two.ms,
            before.as_deref().unwrap_or_default()
        )
    };
    let ok = evidence.starts_with("refresh x2");
    kit.report.push("refresh", ok, evidence);
    if let Err(e) = kit.unpublish(&target, &pctx).await {
        kit.report.push(
            "refresh",
            false,
            format!("unpublish after the refresh failed: {e}"),
        );
    }
    let never = kit.target("never-refreshed");
    let env = kit.unpublish_env(&never, &serde_json::Value::Null);
    let c = kit.call(Operation::Refresh, &env).await;
    kit.report.push(
        "refresh of nothing",
        c.ok(),
        format!("refresh of a target never published: {}", c.describe()),
    );
}
