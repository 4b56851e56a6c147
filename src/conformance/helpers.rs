//! The kit's rule `helper outlives the caller`: a plugin's long-lived helper (a FUSE server)
//! must live in the volume's helper cgroup (`DHV_HELPER_CGROUP`), not in the cgroup of the
//! process that called the plugin. Nomad kills the daemon's whole cgroup when its task stops
//! (an upgrade, a drain, an OOM kill), and a helper left there dies with it, taking the mount
//! of a running task with it (docs/plugin-protocol.md, "Helpers").

use super::{Kit, Operation};
use crate::node::helpers::{self, HelperCgroups};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const RULE: &str = "helper outlives the caller";

/// A scratch cgroup of the kit's: under `--cgroup` when given, else under the cgroup2 mount;
/// every process left in it is killed and it is removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(under: Option<&Path>) -> Result<Scratch, String> {
        let base = match under {
            Some(p) => p.to_path_buf(),
            None => helpers::cgroup2_mount()
                .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?
                .ok_or("no cgroup v2 filesystem is mounted on this machine (see /proc/self/mountinfo): the kit cannot run the plugin as the agent runs under Nomad")?,
        };
        if !helpers::is_cgroup2(&base) {
            return Err(format!(
                "{} is not on a cgroup v2 filesystem (give --cgroup a directory under the cgroup2 mount)",
                base.display()
            ));
        }
        let path = base.join(format!("dhv-binder-check-{}", uuid::Uuid::new_v4()));
        for d in [path.clone(), path.join("caller"), path.join("helpers")] {
            std::fs::create_dir(&d)
                .map_err(|e| format!("cannot make the cgroup {}: {e}", d.display()))?;
        }
        Ok(Scratch(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = helpers::kill(&self.0);
        let deadline = Instant::now() + Duration::from_secs(5);
        while helpers::populated(&self.0).unwrap_or(false) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = helpers::remove(&self.0);
    }
}

/// Writes a file through `target` and reads it back.
fn serves(target: &Path) -> Result<(), String> {
    let probe = target.join(format!(".dhv-check-{}", uuid::Uuid::new_v4()));
    std::fs::write(&probe, b"still served")
        .map_err(|e| format!("a write through it failed: {e}"))?;
    let back = std::fs::read(&probe).map_err(|e| format!("a read through it failed: {e}"))?;
    let _ = std::fs::remove_file(&probe);
    (back == b"still served")
        .then_some(())
        .ok_or_else(|| "a file read back differs from what was written".to_string())
}

/// Publishes with the call in a scratch "caller" cgroup (the daemon's), kills that whole
/// cgroup as Nomad kills a stopped task's, then checks that no process of the plugin was left
/// in it and that the mount still serves reads and writes; unpublishes, and checks the
/// helper cgroup emptied.
pub(super) async fn helper_rule(kit: &mut Kit) {
    let scratch = match Scratch::new(kit.opts.cgroup.as_deref()) {
        Ok(s) => s,
        Err(why) => return kit.report.push(RULE, false, why),
    };
    let hc = HelperCgroups::on(&scratch.0.join("helpers"), None);
    let caller = scratch.0.join("caller");
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            return kit.report.push(
                RULE,
                false,
                format!("cannot find the dhv-binder executable to start calls in a cgroup: {e}"),
            )
        }
    };
    let runner = kit
        .runner
        .clone()
        .with_helpers(hc.clone())
        .in_cgroup(&caller, &exe);
    let rec = kit.rec.clone();
    let target = kit.target("helper");
    if let Err(e) = std::fs::create_dir_all(&target) {
        return kit.report.push(
            RULE,
            false,
            format!("cannot make {}: {e}", target.display()),
        );
    }
    let env = kit.publish_env_of(&rec, &target, false);
    let c = kit.call_with(&runner, Operation::Publish, &env).await;
    if let Err(e) = &c.result {
        return kit
            .report
            .push(RULE, false, format!("publish failed: {}", e.report()));
    }
    let cgroup = hc.path_of(&rec.spec.namespace, &rec.spec.name, &rec.id);
    let helper_pids = helpers::pids(&cgroup);
    let left_in_caller = helpers::pids(&caller);
    // The daemon's cgroup killed outright (an upgrade, a drain, an OOM kill).
    let _ = helpers::kill(&caller);
    let deadline = Instant::now() + Duration::from_secs(5);
    while helpers::populated(&caller).unwrap_or(false) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let verdict = if !left_in_caller.is_empty() {
        Err(format!(
            "processes {left_in_caller:?} stayed in the caller's cgroup after publish returned: they die with the daemon (start long-lived helpers in DHV_HELPER_CGROUP)"
        ))
    } else if !crate::node::mounts::is_mount_point(&target) {
        Err("the target is no longer a mount point after the caller's cgroup was killed".into())
    } else {
        serves(&target).map_err(|e| format!("after the caller's cgroup was killed, {e}"))
    };
    let ctx = c
        .result
        .ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o).ok())
        .and_then(|v| v.get("context").cloned())
        .unwrap_or(serde_json::Value::Null);
    let uenv = kit.unpublish_env_of(&rec, &target, &ctx);
    let u = kit.call_with(&runner, Operation::Unpublish, &uenv).await;
    let verdict = verdict.and_then(|()| match &u.result {
        Err(e) => Err(format!("unpublish afterwards failed: {}", e.report())),
        Ok(_) if cgroup.exists() => Err(format!(
            "the helper cgroup {} is still there after unpublish",
            cgroup.display()
        )),
        Ok(_) => Ok(()),
    });
    match verdict {
        Ok(()) if helper_pids.is_empty() => kit.report.push(
            RULE,
            true,
            "no helper process runs after publish; the mount serves after the caller's cgroup was killed",
        ),
        Ok(()) => kit.report.push(
            RULE,
            true,
            format!(
                "{} helper process(es) in DHV_HELPER_CGROUP; the caller's cgroup killed, the mount still serves reads and writes; after unpublish the helper exited and its cgroup was removed",
                helper_pids.len()
            ),
        ),
        Err(e) => kit.report.push(RULE, false, e),
    }
    if crate::node::mounts::is_mount_point(&target) {
        let _ = nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH);
    }
}
