//! Growing a volume. `dhv-binder volume create` on an existing volume with a larger
//! `capacity_min` (Nomad accepts the same spec again as an update of a dynamic host volume:
//! `HostVolume.ValidateUpdate` and `CanonicalizeForCreate`, nomad/structs/host_volumes.go)
//! records an [`Expansion`] in the volume record. A node then runs the plugin's `expand`:
//! online on the node where the volume is published if the plugin declares `expand_online`,
//! otherwise while the volume is published nowhere (at the latest right before its next
//! publish). Shrinking is refused.

use crate::cluster::worker::OpError;
use crate::storage::environment::NodeEnv;
use crate::storage::plugin::{self, Capability, ExpandResult, Fingerprint, Operation, Runner};
use crate::volume::{VolumeRecord, VolumeSpec, VolumeState};
use std::path::Path;

pub use crate::volume::{Expansion, ExpansionState};

/// A spec given again for an existing volume that cannot be applied. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpdateError {
    #[error("volume {volume} exists with a different {field}: only capacity_min and capacity_max can change on an existing volume (delete it and create it again, or use clone_id)")]
    Immutable { volume: String, field: &'static str },
    /// `current` is the size the volume has (what `volume status` shows), not a growth
    /// still pending.
    #[error("volume {volume} cannot shrink: capacity_min {asked} bytes is below its current {current} bytes (shrinking a filesystem is not supported; create a smaller volume and copy the data)")]
    Shrink {
        volume: String,
        asked: u64,
        current: u64,
    },
    #[error("volume {volume} cannot shrink: capacity_max {asked} bytes is below its provisioned {current} bytes")]
    MaxBelowCurrent {
        volume: String,
        asked: u64,
        current: u64,
    },
    #[error("volume {volume} is {state}: it can grow once it is ready")]
    NotReady { volume: String, state: &'static str },
    /// A growth is running on a node: it can be neither withdrawn nor replaced now.
    #[error("volume {volume} is growing to {bytes} bytes on node {node} now: wait for it to finish (`dhv-binder volume status`), then give the spec again")]
    Running {
        volume: String,
        bytes: u64,
        node: String,
    },
}

/// What applying a spec again does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// Same size: nothing to do (the create is idempotent).
    Unchanged,
    /// Grow from the current size to `to` bytes.
    Grow { from: u64, to: u64 },
    /// Withdraw the pending growth to `pending` bytes (requested, waiting for the next
    /// publish, or failed): the spec's `capacity_min` goes back to `to` (at least the
    /// volume's current size), and nothing grows.
    Withdraw { pending: u64, to: u64 },
}

/// Compares a spec given again with the existing record: growth, no change, or refusal.
pub fn plan_update(existing: &VolumeRecord, new: &VolumeSpec) -> Result<Update, UpdateError> {
    let volume = existing.key().to_string();
    let old = &existing.spec;
    let immutable = |field| {
        Err(UpdateError::Immutable {
            volume: volume.clone(),
            field,
        })
    };
    if new.plugin_id != old.plugin_id {
        return immutable("plugin_id");
    }
    if new.node_pool != old.node_pool {
        return immutable("node_pool");
    }
    if new.capabilities != old.capabilities {
        return immutable("capability");
    }
    if new.parameters != old.parameters {
        return immutable("parameters");
    }
    if new.source != old.source {
        return immutable("snapshot_id/clone_id");
    }
    // The size the plugin reported (a growth request raises the spec's capacity_min before
    // the volume has grown); the spec's capacity_min when the plugin reported none.
    let current = match existing.capacity_bytes {
        0 => old.capacity_min,
        n => n,
    };
    if new.capacity_max > 0 && new.capacity_max < current {
        return Err(UpdateError::MaxBelowCurrent {
            volume,
            asked: new.capacity_max,
            current,
        });
    }
    if new.capacity_min < old.capacity_min {
        // Back to the size the volume has: withdraws a growth not yet applied (the record's
        // spec says the growth's size until then, `volume status` the volume's).
        match &existing.expansion {
            Some(x) if new.capacity_min >= current && x.state == ExpansionState::Running => {
                return Err(UpdateError::Running {
                    volume,
                    bytes: x.bytes,
                    node: x.node.clone(),
                })
            }
            Some(x) if new.capacity_min >= current => {
                return Ok(Update::Withdraw {
                    pending: x.bytes,
                    to: new.capacity_min,
                })
            }
            _ => {}
        }
        return Err(UpdateError::Shrink {
            volume,
            asked: new.capacity_min,
            current: if new.capacity_min < current {
                current
            } else {
                old.capacity_min
            },
        });
    }
    if new.capacity_min <= current {
        return Ok(Update::Unchanged);
    }
    // The same growth already requested and not failed: nothing to add.
    if existing
        .expansion
        .as_ref()
        .is_some_and(|x| x.bytes == new.capacity_min && x.state != ExpansionState::Failed)
    {
        return Ok(Update::Unchanged);
    }
    if existing.state != VolumeState::Ready {
        return Err(UpdateError::NotReady {
            volume,
            state: existing.state.as_str(),
        });
    }
    Ok(Update::Grow {
        from: current,
        to: new.capacity_min,
    })
}

/// Withdraws `rec`'s pending growth as `volume create` with the smaller size asks: the
/// spec's `capacity_min` becomes `to` (the operator signs the spec again), and the request
/// is gone (a publish held for it goes ahead).
pub fn withdraw(rec: &mut VolumeRecord, to: u64) {
    rec.spec.capacity_min = to;
    rec.expansion = None;
}

/// Records a growth of `rec` to `to` bytes as `volume create` requests it: the spec's
/// `capacity_min` (signed by the operator with the rest of the spec) becomes `to`, and the
/// request waits for a node. Nodes grow a volume only up to its spec's `capacity_min`.
pub fn request(rec: &mut VolumeRecord, to: u64) {
    rec.spec.capacity_min = to;
    rec.expansion = Some(Expansion::requested(to));
}

/// What a node does about a volume's pending expansion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing here (no expansion, not this node's, or waiting).
    None,
    /// Run `expand`; `online`: the volume is mounted here and grows under its users.
    Run { online: bool },
    /// Published here, and the plugin cannot grow it online: mark the expansion
    /// [`ExpansionState::AtNextPublish`].
    Defer,
    /// The plugin does not declare `expand`: fail the expansion with this message.
    Refuse(String),
}

/// Decides this node's step for `rec`'s expansion. `fp`: the plugin's fingerprint on this
/// node (`None` = the plugin is not here).
pub fn step(
    rec: &VolumeRecord,
    me: &str,
    published: crate::cluster::worker::Published,
    fp: Option<&Fingerprint>,
) -> Step {
    use crate::cluster::worker::Published;
    let Some(x) = &rec.expansion else {
        return Step::None;
    };
    if rec.state != VolumeState::Ready || x.state == ExpansionState::Failed {
        return Step::None;
    }
    if x.state == ExpansionState::Running && x.node != me {
        return Step::None;
    }
    if !crate::cluster::worker::runs_here(me, &x.node, published, fp.is_some()) {
        return Step::None;
    }
    let Some(fp) = fp else { return Step::None };
    // The size comes from the spec the operator signed (`volume create` raises capacity_min
    // with the request); the unsigned request alone cannot grow a volume.
    if x.bytes > rec.spec.capacity_min {
        return Step::Refuse(format!(
            "the expansion asks for {} bytes, more than the volume spec's capacity_min ({} bytes): request growth with `dhv-binder volume create` and the larger capacity_min",
            x.bytes, rec.spec.capacity_min
        ));
    }
    if let Err(e) = fp.require(&rec.spec.plugin_id, Operation::Expand) {
        return Step::Refuse(e.to_string());
    }
    match published {
        Published::Here if fp.supports(Capability::ExpandOnline) => Step::Run { online: true },
        Published::Here if x.state == ExpansionState::AtNextPublish => Step::None,
        Published::Here => Step::Defer,
        _ => Step::Run { online: false },
    }
}

/// Environment of `expand`: the volume's identity, `DHV_CONTEXT`, the new
/// `DHV_CAPACITY_MIN_BYTES` / `DHV_CAPACITY_MAX_BYTES`, and `DHV_TARGET_PATH` (the mounted
/// target when online, `""` when the volume is published nowhere).
pub fn expand_env(
    node: &NodeEnv,
    rec: &VolumeRecord,
    bytes: u64,
    target: Option<&Path>,
) -> Vec<(String, String)> {
    let mut env = crate::storage::environment::identity_env(node, rec);
    env.extend([
        ("DHV_CONTEXT".into(), rec.context.to_string()),
        ("DHV_CAPACITY_MIN_BYTES".into(), bytes.to_string()),
        (
            "DHV_CAPACITY_MAX_BYTES".into(),
            rec.spec.capacity_max.to_string(),
        ),
        (
            "DHV_TARGET_PATH".into(),
            target.map(|t| t.display().to_string()).unwrap_or_default(),
        ),
    ]);
    env
}

/// Runs the plugin's `expand` for `rec`'s pending expansion and returns the record as it
/// should be written: the new `capacity_bytes` and no expansion on success, the expansion
/// `failed` with the (redacted) error on a plugin failure. A timeout is returned as `Err`
/// (the outcome is unknown; the same node calls `expand` again, which is idempotent).
/// `target`: the published target when growing online.
pub async fn run_expand(
    runner: &Runner,
    node: &NodeEnv,
    mut rec: VolumeRecord,
    target: Option<&Path>,
) -> Result<VolumeRecord, OpError> {
    let Some(mut x) = rec.expansion.clone() else {
        return Ok(rec);
    };
    let mut env = expand_env(node, &rec, x.bytes, target);
    // The volume's referenced secrets, read now (never stored in `rec`, written back).
    let secrets = match runner.secrets_for(Operation::Expand, &rec).await {
        Ok(s) => s,
        Err(e) => {
            return Err(OpError::retried(&e, &rec.secrets)
                .unwrap_or_else(|| OpError::Plugin(plugin::redact(&e.to_string(), &rec.secrets))))
        }
    };
    crate::storage::environment::set_secrets(&mut env, &secrets);
    let out = runner
        .call(&rec.spec.plugin_id, Operation::Expand, &env, &secrets)
        .await
        .and_then(|o| {
            plugin::parse::<ExpandResult>(&rec.spec.plugin_id, Operation::Expand, &o.stdout)
        });
    match out {
        Ok(res) if res.bytes >= x.bytes || res.bytes == 0 => {
            // The spec is the operator's (signed, with the new capacity_min already): only
            // the size and the request change.
            rec.capacity_bytes = res.bytes.max(x.bytes);
            rec.expansion = None;
        }
        Ok(res) => {
            x.state = ExpansionState::Failed;
            x.error = format!(
                "plugin {:?} expand reported {} bytes, less than the {} asked",
                rec.spec.plugin_id, res.bytes, x.bytes
            );
            rec.expansion = Some(x);
        }
        Err(e) => {
            if let Some(again) = OpError::retried(&e, &secrets) {
                return Err(again);
            }
            x.state = ExpansionState::Failed;
            // The plugin's redacted words, as a failed create records them: the operator's
            // `volume create` and `volume status` show them on their machine.
            x.error = plugin::redact(&e.report(), &secrets);
            rec.expansion = Some(x);
        }
    }
    Ok(rec)
}

/// Takes the expansion for this node with a check-and-set write (state `running`, `node` =
/// this node), runs `expand`, and writes the outcome the same way. Returns the record as
/// written.
pub async fn expand(
    client: &crate::nomad::Client,
    runner: &Runner,
    node: &NodeEnv,
    mut rec: VolumeRecord,
    target: Option<&Path>,
) -> Result<VolumeRecord, OpError> {
    let Some(x) = rec.expansion.as_mut() else {
        return Ok(rec);
    };
    if x.state != ExpansionState::Running || x.node != node.node_id {
        x.state = ExpansionState::Running;
        x.node = node.node_id.clone();
        x.error.clear();
        rec = write(client, &rec).await?;
    }
    let done = run_expand(runner, node, rec, target).await?;
    write(client, &done).await
}

/// Marks the expansion as waiting for the next publish (the plugin cannot grow it online),
/// keeping `node` (the node where it is published) as its owner: that node grows it offline
/// once it has unpublished it, and every other node holds its publishes until then (another
/// node must not grow the image from under the mount).
pub async fn defer(
    client: &crate::nomad::Client,
    mut rec: VolumeRecord,
    node: &str,
) -> Result<VolumeRecord, OpError> {
    if let Some(x) = rec.expansion.as_mut() {
        x.state = ExpansionState::AtNextPublish;
        x.node = node.to_string();
    }
    write(client, &rec).await
}

/// Fails the expansion with `message` (the plugin does not declare `expand`).
pub async fn refuse(
    client: &crate::nomad::Client,
    mut rec: VolumeRecord,
    message: String,
) -> Result<VolumeRecord, OpError> {
    if let Some(x) = rec.expansion.as_mut() {
        x.state = ExpansionState::Failed;
        x.node.clear();
        x.error = message;
    }
    write(client, &rec).await
}

async fn write(client: &crate::nomad::Client, rec: &VolumeRecord) -> Result<VolumeRecord, OpError> {
    let var = crate::cluster::worker::put_cas(client, &rec.to_variable(), rec.modify_index).await?;
    Ok(VolumeRecord::from_variable(&var)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::worker::Published;
    use std::collections::BTreeMap;

    fn ready(min: u64, bytes: u64) -> VolumeRecord {
        let (mut spec, _) =
            crate::volume::parse_spec("name = \"v\"\nplugin_id = \"ext4\"").unwrap();
        spec.capacity_min = min;
        let mut rec = VolumeRecord::new(spec, BTreeMap::new());
        rec.state = VolumeState::Ready;
        rec.capacity_bytes = bytes;
        rec
    }

    #[test]
    fn a_larger_capacity_min_grows_a_smaller_one_is_refused() {
        let rec = ready(64 << 20, 64 << 20);
        let mut spec = rec.spec.clone();
        assert_eq!(plan_update(&rec, &spec), Ok(Update::Unchanged));
        spec.capacity_min = 128 << 20;
        assert_eq!(
            plan_update(&rec, &spec),
            Ok(Update::Grow {
                from: 64 << 20,
                to: 128 << 20
            })
        );
        spec.capacity_min = 32 << 20;
        let e = plan_update(&rec, &spec).unwrap_err();
        assert!(matches!(e, UpdateError::Shrink { .. }), "{e}");
        assert!(e.to_string().contains("cannot shrink"), "{e}");
        // Nomad's rule: capacity_max below the provisioned size is refused.
        spec.capacity_min = 64 << 20;
        spec.capacity_max = 32 << 20;
        assert!(matches!(
            plan_update(&rec, &spec),
            Err(UpdateError::MaxBelowCurrent { .. })
        ));
        // Anything else differing is refused, naming the field.
        let mut other = rec.spec.clone();
        other.plugin_id = "bind".into();
        assert!(matches!(
            plan_update(&rec, &other),
            Err(UpdateError::Immutable {
                field: "plugin_id",
                ..
            })
        ));
        let mut other = rec.spec.clone();
        other.parameters.insert("dir".into(), "/elsewhere".into());
        assert!(matches!(
            plan_update(&rec, &other),
            Err(UpdateError::Immutable {
                field: "parameters",
                ..
            })
        ));
        // A volume still being created cannot grow yet.
        let mut pending = rec.clone();
        pending.state = VolumeState::Creating;
        let mut spec = rec.spec.clone();
        spec.capacity_min = 1 << 30;
        assert!(matches!(
            plan_update(&pending, &spec),
            Err(UpdateError::NotReady { .. })
        ));
    }

    /// Issue 46 #1: a growth that failed (or still waits) is withdrawn by giving the size
    /// the volume has again, and a real shrink names the size `volume status` shows, not
    /// the pending growth's; a growth that runs now can only be waited for.
    #[test]
    fn a_pending_or_failed_growth_is_withdrawn_and_a_shrink_names_the_real_size() {
        let mut rec = ready(64 << 20, 64 << 20);
        request(&mut rec, 128 << 20);
        rec.expansion.as_mut().unwrap().state = ExpansionState::Failed;
        let mut spec = rec.spec.clone();
        spec.capacity_min = 64 << 20;
        assert_eq!(
            plan_update(&rec, &spec),
            Ok(Update::Withdraw {
                pending: 128 << 20,
                to: 64 << 20
            })
        );
        // The failed growth asked again: a new request (placed again by the CLI).
        spec.capacity_min = 128 << 20;
        assert_eq!(
            plan_update(&rec, &spec),
            Ok(Update::Grow {
                from: 64 << 20,
                to: 128 << 20
            })
        );
        spec.capacity_min = 32 << 20;
        let e = plan_update(&rec, &spec).unwrap_err();
        assert!(
            e.to_string().contains("below its current 67108864 bytes"),
            "{e}"
        );
        let x = rec.expansion.as_mut().unwrap();
        x.state = ExpansionState::Running;
        x.node = "n2".into();
        spec.capacity_min = 64 << 20;
        let e = plan_update(&rec, &spec).unwrap_err();
        assert!(matches!(e, UpdateError::Running { .. }), "{e}");
        assert!(e.to_string().contains("node n2"), "{e}");
        let mut done = rec.clone();
        withdraw(&mut done, 64 << 20);
        assert_eq!((done.spec.capacity_min, done.expansion), (64 << 20, None));
    }

    fn fp(caps: &[&str]) -> Fingerprint {
        Fingerprint {
            version: "1.0.0".into(),
            deferred_bind: true,
            capabilities: caps.iter().map(|c| c.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn online_where_published_if_declared_else_at_the_next_publish() {
        let mut rec = ready(64 << 20, 64 << 20);
        assert_eq!(
            step(&rec, "n1", Published::Nowhere, Some(&fp(&["expand"]))),
            Step::None
        );
        rec.expansion = Some(Expansion::requested(128 << 20));
        // A request beyond the signed spec (a node's token wrote it, not the operator's
        // `volume create`) is refused.
        match step(&rec, "n1", Published::Nowhere, Some(&fp(&["expand"]))) {
            Step::Refuse(m) => assert!(m.contains("capacity_min"), "{m}"),
            other => panic!("{other:?}"),
        }
        rec.spec.capacity_min = 128 << 20;
        let online = fp(&["expand", "expand_online"]);
        let offline = fp(&["expand"]);
        assert_eq!(
            step(&rec, "n1", Published::Here, Some(&online)),
            Step::Run { online: true }
        );
        assert_eq!(
            step(&rec, "n1", Published::Here, Some(&offline)),
            Step::Defer
        );
        assert_eq!(
            step(&rec, "n1", Published::Elsewhere, Some(&online)),
            Step::None
        );
        assert_eq!(step(&rec, "n1", Published::Nowhere, None), Step::None);
        assert_eq!(
            step(&rec, "n1", Published::Nowhere, Some(&offline)),
            Step::Run { online: false }
        );
        // Deferred: waits while published here, runs once published nowhere.
        rec.expansion.as_mut().unwrap().state = ExpansionState::AtNextPublish;
        assert_eq!(
            step(&rec, "n1", Published::Here, Some(&offline)),
            Step::None
        );
        assert_eq!(
            step(&rec, "n1", Published::Nowhere, Some(&offline)),
            Step::Run { online: false }
        );
        // Taken by another node: not here.
        let x = rec.expansion.as_mut().unwrap();
        x.state = ExpansionState::Running;
        x.node = "n2".into();
        assert_eq!(
            step(&rec, "n1", Published::Nowhere, Some(&offline)),
            Step::None
        );
        // A plugin without "expand" is refused by name.
        rec.expansion = Some(Expansion::requested(128 << 20));
        match step(&rec, "n1", Published::Nowhere, Some(&fp(&[]))) {
            Step::Refuse(m) => assert!(m.contains("\"ext4\"") && m.contains("expand"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn expand_records_the_new_size_or_the_failure() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let plugin = dir.path().join("ext4");
        std::fs::write(
            &plugin,
            "#!/bin/sh\ncase \"$DHV_CAPACITY_MIN_BYTES\" in\n 134217728) echo \"{\\\"bytes\\\":$DHV_CAPACITY_MIN_BYTES}\";;\n 536870912) echo '{\"error\":\"still mounted\"}'; exit 75;;\n *) echo '{\"error\":\"no room\"}'; exit 1;;\nesac\n",
        )
        .unwrap();
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let runner = Runner::new(dir.path(), std::time::Duration::from_secs(5));
        let node = NodeEnv {
            node_id: "n1".into(),
            node_pool: "default".into(),
            volumes_dir: dir.path().join("volumes"),
            plugin_dir: dir.path().to_path_buf(),
        };
        // As `volume create` requests it: the spec says the new size, the record the old.
        let mut rec = ready(128 << 20, 64 << 20);
        rec.expansion = Some(Expansion::requested(128 << 20));
        let done = run_expand(&runner, &node, rec.clone(), None).await.unwrap();
        assert_eq!(done.capacity_bytes, 128 << 20);
        assert_eq!(
            done.spec, rec.spec,
            "the signed spec is never changed by a node"
        );
        assert_eq!(done.expansion, None);
        rec.spec.capacity_min = 256 << 20;
        rec.expansion = Some(Expansion::requested(256 << 20));
        let failed = run_expand(&runner, &node, rec.clone(), None).await.unwrap();
        let x = failed.expansion.unwrap();
        assert_eq!(x.state, ExpansionState::Failed);
        // Issue 46: the plugin's own (redacted) words are in the record, as a create's are,
        // not a pointer to the agent's log on another machine.
        assert!(
            x.error.contains("expand failed") && x.error.contains("no room"),
            "{}",
            x.error
        );
        assert!(!x.error.contains("agent's log"), "{}", x.error);
        assert_eq!(failed.capacity_bytes, 64 << 20);
        // Exit code 75: not now. Nothing is recorded; the agent calls again after a backoff.
        request(&mut rec, 512 << 20);
        match run_expand(&runner, &node, rec, None).await {
            Err(OpError::NotNow(e)) => assert!(e.contains("exit code 75"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
}
