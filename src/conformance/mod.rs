//! The plugin conformance kit (`dhv-binder plugin check <executable>`): runs a plugin through
//! the protocol (docs/plugin-protocol.md) exactly as the agent calls it, in a scratch
//! directory, and reports per rule whether it passed, with the evidence.
//!
//! Rules: fingerprint shape and speed; deferred binding; each operation repeated 10 times
//! (idempotence); unpublish and delete of something absent; publish to a target that is
//! already mounted; read-only publish; the mount flags on the target (`nosuid,nodev` by
//! default, a spec's `noexec`, read from the mount table); unpublish while a file is open
//! inside (must fail and
//! leave the mount); data kept across publishes; concurrent calls on one
//! volume; calls killed by the timeout, then retried; a helper outliving the kill of the
//! caller's cgroup; an unpublish with the storage unreachable and a write only in the
//! plugin's cache (must fail, [`flush`]); a directory swapped for a symlink to the outside
//! while publishing, creating and deleting ([`race`]); output shape (one JSON object on
//! stdout, `{"error":…}` on failure, unknown operations refused); nothing left mounted.
//! The optional operations a plugin declares (snapshots, clones, expand, `fence`,
//! `fence_node`/`unfence_node`) have their own rules ([`storage`]); one not declared is
//! reported as skipped, never failed.
//! A plugin without `deferred_bind` is checked against Nomad's plain DHV contract
//! (fingerprint, create, delete) and reported as not deferred.

use crate::node::journal::{MountRecord, MountState};
use crate::storage::environment::{self, NodeEnv};
use crate::storage::plugin::{Operation, PluginError, Runner};
use crate::volume::mount_options::MountOptions;
use crate::volume::{Capability, VolumeRecord, VolumeSpec, VolumeState};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod flush;
mod health;
mod helpers;
mod placement;
mod race;
mod refresh;
mod report;
mod storage;

pub use report::{Report, RULES};

/// How many times each operation is repeated.
pub const REPEAT: usize = 10;
/// Nomad's effective fingerprint limit (1 s): a slower plugin drops out of Nomad's node.
pub const NOMAD_FINGERPRINT_LIMIT: Duration = Duration::from_secs(1);

/// What to check and with which volume.
#[derive(Debug, Clone)]
pub struct Options {
    /// The plugin executable.
    pub plugin: PathBuf,
    /// DHV_PARAMETERS of the test volume.
    pub parameters: BTreeMap<String, String>,
    /// DHV_SECRETS of the test volume.
    pub secrets: BTreeMap<String, String>,
    /// DHV_CAPACITY_MIN_BYTES / MAX of the test volume.
    pub capacity: u64,
    /// The timeout of every call (as the agent's `--plugin-timeout`).
    pub timeout: Duration,
    /// Scratch directory (volumes dir and targets); removed afterwards when created here.
    pub scratch: Option<PathBuf>,
    /// The test node's `--plugin-root`s for the plugin (`DHV_ALLOWED_ROOTS`), besides the
    /// scratch volumes dir and every parameter value that is an absolute path (the test
    /// volume's own storage).
    pub roots: Vec<PathBuf>,
    /// Where the kit makes its scratch cgroups (rule `helper outlives the caller`); `None`:
    /// under the cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// Run only these rules (`-rule`, names from [`RULES`]), with the steps they need
    /// (fingerprint, one create, one delete); empty: every rule.
    pub only: Vec<String>,
    /// Rules the plugin's author says do not apply (`-skip`): not run, shown as skipped.
    /// Any other rule that cannot run with what the kit was given fails the run.
    pub skip: Vec<String>,
}

/// Why the kit could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("{0} is not a file name usable as a plugin ID (letters, digits, '_', '.', '-')")]
    BadName(PathBuf),
    #[error("plugin {0} does not exist")]
    Missing(PathBuf),
    #[error("there is no rule {0:?}; the rules: {rules}", rules = RULES.join(", "))]
    UnknownRule(String),
    #[error("the rule {0:?} cannot be skipped: the other rules need what it does (fingerprint, create, delete, nothing left mounted)")]
    NotSkippable(String),
    #[error("cannot prepare the scratch directory {path}: {source}")]
    Scratch {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One plugin call's outcome as the kit sees it.
struct Call {
    result: Result<Vec<u8>, PluginError>,
    ms: u64,
}

impl Call {
    fn ok(&self) -> bool {
        self.result.is_ok()
    }

    fn describe(&self) -> String {
        match &self.result {
            Ok(out) => format!("ok {}", short(&String::from_utf8_lossy(out))),
            // The plugin's words in full (the report is one line of at most 512 characters):
            // the failing call's error is the evidence.
            Err(e) => format!("error: {}", e.report()),
        }
    }
}

fn short(s: &str) -> String {
    let s = s.trim();
    if s.chars().count() > 160 {
        format!("{}…", s.chars().take(160).collect::<String>())
    } else {
        s.to_string()
    }
}

/// A repeated rule's errors (`call N: why`), consecutive calls that failed the same way
/// named together (`calls 1-10: why`), so that the plugin's words show once.
fn joined(errors: &[String]) -> String {
    let mut groups: Vec<(String, String, String)> = Vec::new();
    for e in errors {
        let Some((n, why)) = e.strip_prefix("call ").and_then(|r| r.split_once(": ")) else {
            groups.push((String::new(), String::new(), e.clone()));
            continue;
        };
        match groups.last_mut() {
            Some((first, last, w)) if !first.is_empty() && w == why => *last = n.to_string(),
            _ => groups.push((n.to_string(), n.to_string(), why.to_string())),
        }
    }
    groups
        .into_iter()
        .map(
            |(first, last, why)| match (first.is_empty(), first == last) {
                (true, _) => why,
                (false, true) => format!("call {first}: {why}"),
                (false, false) => format!("calls {first}-{last}: {why}"),
            },
        )
        .collect::<Vec<_>>()
        .join("; ")
}

/// Entries that repeat said once, with how many times (`… (x10)`), in the order first seen:
/// a rule over every call names each way of going wrong once.
fn counted(entries: &[String]) -> Vec<String> {
    let mut seen: Vec<(&String, usize)> = Vec::new();
    for e in entries {
        match seen.iter_mut().find(|(s, _)| *s == e) {
            Some((_, n)) => *n += 1,
            None => seen.push((e, 1)),
        }
    }
    seen.into_iter()
        .map(|(e, n)| {
            if n == 1 {
                e.clone()
            } else {
                format!("{e} (x{n})")
            }
        })
        .collect()
}

/// Stdout must be empty or one JSON object and nothing else.
fn strict_object(stdout: &[u8]) -> Result<serde_json::Value, String> {
    let text = String::from_utf8_lossy(stdout);
    if text.trim().is_empty() {
        return Ok(serde_json::json!({}));
    }
    match serde_json::from_str::<serde_json::Value>(text.trim()) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(format!("not a JSON object: {}", short(&text))),
        Err(e) => Err(format!("not one JSON object ({e}): {}", short(&text))),
    }
}

fn mount_count(target: &Path) -> usize {
    crate::node::mounts::mount_count(target)
}

fn median(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

struct Kit {
    runner: Runner,
    /// The runner's `DHV_ALLOWED_ROOTS` per plugin ID (for runners made later).
    allowed: BTreeMap<String, String>,
    plugin_id: String,
    node: NodeEnv,
    rec: VolumeRecord,
    scratch: PathBuf,
    opts: Options,
    report: Report,
    /// Every failed call's stdout, for the output-shape rule.
    bad_outputs: Vec<String>,
    /// Calls that ended with a process outside their group still holding stdout or stderr.
    output_holders: Vec<String>,
    calls: usize,
    /// The optional operations the fingerprint declares.
    capabilities: Vec<String>,
    /// Every failed publish: its class and the failure ([`placement::classes_rule`]).
    publish_failures: Vec<(crate::storage::error_class::ErrorClass, String)>,
}

impl Kit {
    async fn call_with(
        &mut self,
        runner: &Runner,
        op: Operation,
        env: &[(String, String)],
    ) -> Call {
        let started = Instant::now();
        let result = runner
            .call(&self.plugin_id, op, env, &self.rec.secrets)
            .await;
        self.finish(op, started, result)
    }

    /// [`Kit::call`] bounded by `timeout` instead of the kit's call timeout.
    async fn call_within(
        &mut self,
        op: Operation,
        env: &[(String, String)],
        timeout: std::time::Duration,
    ) -> Call {
        let started = Instant::now();
        let result = self
            .runner
            .call_within(&self.plugin_id, op, env, &self.rec.secrets, timeout)
            .await;
        self.finish(op, started, result)
    }

    fn finish(
        &mut self,
        op: Operation,
        started: Instant,
        result: Result<crate::storage::plugin::Output, PluginError>,
    ) -> Call {
        let result = result.map(|o| {
            if !o.leftover.is_empty() {
                let who: Vec<String> = o.leftover.iter().map(|l| l.to_string()).collect();
                self.output_holders
                    .push(format!("{op}: {}", who.join(", ")));
            }
            o.stdout
        });
        let ms = started.elapsed().as_millis() as u64;
        self.calls += 1;
        self.report.timings.entry(op.as_str()).or_default().push(ms);
        match &result {
            Ok(out) => {
                if let Err(e) = strict_object(out) {
                    self.bad_outputs.push(format!("{op}: {e}"));
                }
            }
            Err(PluginError::Failed {
                message,
                status,
                stderr,
                ..
            }) if message.is_empty() => {
                let tail: String = stderr
                    .trim()
                    .chars()
                    .rev()
                    .take(300)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                self.bad_outputs.push(format!(
                    "{op} failed ({status}) without {{\"error\":\"…\"}} on stdout; stderr: {tail}"
                ));
            }
            Err(PluginError::BadOutput { .. }) => {}
            Err(_) => {}
        }
        if let (Operation::Publish, Err(PluginError::Failed { status, class, .. })) = (op, &result)
        {
            let class =
                class.unwrap_or_else(|| crate::storage::error_class::ErrorClass::of_status(status));
            let e = result
                .as_ref()
                .err()
                .map(|e| e.report())
                .unwrap_or_default();
            self.publish_failures.push((class, e));
        }
        Call { result, ms }
    }

    async fn call(&mut self, op: Operation, env: &[(String, String)]) -> Call {
        let runner = self.runner.clone();
        self.call_with(&runner, op, env).await
    }

    fn target(&self, name: &str) -> PathBuf {
        self.scratch.join("targets").join(name)
    }

    fn publish_env(&self, target: &Path, read_only: bool) -> Vec<(String, String)> {
        self.publish_env_of(&self.rec, target, read_only)
    }

    fn publish_env_of(
        &self,
        rec: &VolumeRecord,
        target: &Path,
        read_only: bool,
    ) -> Vec<(String, String)> {
        environment::publish_env(
            &self.node,
            rec,
            target,
            read_only,
            "00000000-0000-4000-8000-000000000001",
        )
    }

    fn unpublish_env(&self, target: &Path, ctx: &serde_json::Value) -> Vec<(String, String)> {
        self.unpublish_env_of(&self.rec, target, ctx)
    }

    fn unpublish_env_of(
        &self,
        rec: &VolumeRecord,
        target: &Path,
        ctx: &serde_json::Value,
    ) -> Vec<(String, String)> {
        let m = MountRecord {
            volume: rec.key(),
            volume_id: rec.id.clone(),
            plugin_id: self.plugin_id.clone(),
            state: MountState::Unpublishing,
            target: target.to_path_buf(),
            read_only: false,
            publish_context: ctx.clone().into(),
            since: 0,
            last_error: String::new(),
            claim_id: None,
            mount: None,
        };
        environment::unpublish_env(&self.node, &m, Some(rec))
    }

    /// Publishes to `target` and checks the result; returns the publish context.
    async fn publish(
        &mut self,
        target: &Path,
        read_only: bool,
    ) -> Result<serde_json::Value, String> {
        let rec = self.rec.clone();
        self.publish_rec(&rec, target, read_only).await
    }

    /// Publishes `rec` to `target` and checks the result; returns the publish context.
    async fn publish_rec(
        &mut self,
        rec: &VolumeRecord,
        target: &Path,
        read_only: bool,
    ) -> Result<serde_json::Value, String> {
        std::fs::create_dir_all(target).map_err(|e| e.to_string())?;
        let env = self.publish_env_of(rec, target, read_only);
        let c = self.call(Operation::Publish, &env).await;
        let out = c.result.map_err(|e| e.report())?;
        let v = strict_object(&out)?;
        if let Some(p) = v.get("path").and_then(|p| p.as_str()) {
            if Path::new(p) != target {
                return Err(format!(
                    "printed path {p}, not the target {}",
                    target.display()
                ));
            }
        }
        if !crate::node::mounts::is_mount_point(target) {
            return Err(format!(
                "succeeded but {} is not a mount point",
                target.display()
            ));
        }
        Ok(v.get("context").cloned().unwrap_or(serde_json::Value::Null))
    }

    async fn unpublish(&mut self, target: &Path, ctx: &serde_json::Value) -> Result<(), String> {
        let rec = self.rec.clone();
        self.unpublish_rec(&rec, target, ctx).await
    }

    async fn unpublish_rec(
        &mut self,
        rec: &VolumeRecord,
        target: &Path,
        ctx: &serde_json::Value,
    ) -> Result<(), String> {
        let env = self.unpublish_env_of(rec, target, ctx);
        let c = self.call(Operation::Unpublish, &env).await;
        c.result.map_err(|e| e.report())?;
        if crate::node::mounts::is_mount_point(target) {
            return Err(format!(
                "succeeded but {} is still mounted",
                target.display()
            ));
        }
        Ok(())
    }
}

/// Runs every rule against `opts.plugin`.
pub async fn check(opts: Options) -> Result<Report, CheckError> {
    if let Some(r) = opts
        .only
        .iter()
        .chain(&opts.skip)
        .find(|r| !RULES.contains(&r.as_str()))
    {
        return Err(CheckError::UnknownRule(r.clone()));
    }
    if let Some(r) = opts.skip.iter().find(|r| {
        [
            "fingerprint",
            "deferred_bind",
            "create x10",
            "delete x10",
            "nothing left mounted",
        ]
        .contains(&r.as_str())
    }) {
        return Err(CheckError::NotSkippable(r.clone()));
    }
    let plugin = std::path::absolute(&opts.plugin).unwrap_or(opts.plugin.clone());
    if !plugin.is_file() {
        return Err(CheckError::Missing(plugin));
    }
    let plugin_id = plugin
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| crate::volume::validate_identifier("plugin_id", n, false).is_ok())
        .ok_or_else(|| CheckError::BadName(plugin.clone()))?
        .to_string();
    let plugin_dir = plugin.parent().unwrap_or(Path::new("/")).to_path_buf();
    let (scratch, ours) = match &opts.scratch {
        Some(s) => (s.clone(), false),
        None => (
            std::env::temp_dir().join(format!("dhv-binder-check-{}", uuid::Uuid::new_v4())),
            true,
        ),
    };
    let volumes_dir = scratch.join("volumes");
    for d in [&volumes_dir, &scratch.join("targets")] {
        std::fs::create_dir_all(d).map_err(|source| CheckError::Scratch {
            path: d.clone(),
            source,
        })?;
    }
    let spec = VolumeSpec {
        name: "conformance".into(),
        namespace: "default".into(),
        plugin_id: plugin_id.clone(),
        capacity_min: opts.capacity,
        capacity_max: opts.capacity,
        node_pool: String::new(),
        capabilities: vec![Capability {
            access_mode: "single-node-writer".into(),
            attachment_mode: "file-system".into(),
        }],
        parameters: opts.parameters.clone(),
        source: Default::default(),
        mount_options: Default::default(),
        secret_refs: Default::default(),
        constraints: Vec::new(),
        topology_request: Default::default(),
        availability: Default::default(),
    };
    let mut rec = VolumeRecord::new(spec, opts.secrets.clone());
    rec.state = VolumeState::Ready;
    // The test node's `--plugin-root`s, passed as a node passes them (the runner's
    // DHV_ALLOWED_ROOTS): canonical where they exist (a parameter's directory may not yet).
    let roots: Vec<String> = std::iter::once(volumes_dir.clone())
        .chain(opts.roots.iter().cloned())
        .chain(
            opts.parameters
                .values()
                .filter(|v| v.starts_with('/'))
                .map(PathBuf::from),
        )
        .map(|r| r.canonicalize().unwrap_or(r).display().to_string())
        .collect();
    let allowed = BTreeMap::from([(plugin_id.clone(), roots.join(":"))]);
    let mut kit = Kit {
        runner: Runner::new(&plugin_dir, opts.timeout).with_allowed_roots(allowed.clone()),
        allowed,
        plugin_id,
        node: NodeEnv {
            node_id: uuid::Uuid::new_v4().to_string(),
            node_pool: "default".into(),
            volumes_dir,
            plugin_dir,
        },
        capabilities: Vec::new(),
        publish_failures: Vec::new(),
        rec,
        scratch: scratch.clone(),
        opts: opts.clone(),
        report: Report {
            plugin: plugin.clone(),
            only: opts.only.clone(),
            waived: opts.skip.iter().cloned().collect(),
            ..Default::default()
        },
        bad_outputs: Vec::new(),
        output_holders: Vec::new(),
        calls: 0,
    };
    run_rules(&mut kit).await;
    // Leave nothing behind, whatever happened.
    let mut left = crate::node::mounts::mounts_under(&scratch);
    left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    let leftover = left.clone();
    for m in left {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    kit.report.push(
        "nothing left mounted",
        leftover.is_empty(),
        if leftover.is_empty() {
            format!(
                "{} calls; no mount left under the scratch directory",
                kit.calls
            )
        } else {
            format!("still mounted after the last unpublish: {leftover:?}")
        },
    );
    if ours {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    kit.report.finish();
    Ok(kit.report)
}

async fn run_rules(kit: &mut Kit) {
    // fingerprint: exactly Nomad's call (DHV_OPERATION only).
    let mut fps = Vec::new();
    for _ in 0..REPEAT {
        fps.push(kit.call(Operation::Fingerprint, &[]).await);
    }
    let first = &fps[0];
    let parsed = match &first.result {
        Ok(out) => strict_object(out).and_then(|v| {
            let version = v.get("version").and_then(|x| x.as_str()).unwrap_or("");
            let ok = version
                .trim_start_matches('v')
                .split(['-', '+'])
                .next()
                .is_some_and(|core| {
                    !core.is_empty() && core.split('.').all(|p| p.parse::<u64>().is_ok())
                });
            if !ok {
                return Err(format!("\"version\" {version:?} is not a version (X.Y.Z)"));
            }
            match v.get("deferred_bind") {
                None | Some(serde_json::Value::Bool(_)) => Ok(v),
                Some(x) => Err(format!("\"deferred_bind\" must be true or false, got {x}")),
            }
        }),
        Err(e) => Err(e.report()),
    };
    let slowest = fps.iter().map(|c| c.ms).max().unwrap_or(0);
    let same = fps
        .iter()
        .all(|c| c.result.as_ref().ok() == first.result.as_ref().ok());
    match &parsed {
        Ok(v) => kit.report.push(
            "fingerprint",
            same && Duration::from_millis(slowest) < NOMAD_FINGERPRINT_LIMIT,
            format!(
                "{} (x{REPEAT}, {}; slowest {slowest} ms, Nomad allows 1000 ms)",
                v,
                if same {
                    "same answer each time"
                } else {
                    "answers DIFFER"
                }
            ),
        ),
        Err(e) => kit.report.push("fingerprint", false, e.clone()),
    }
    let Ok(fp) = parsed else {
        return;
    };
    let deferred = fp.get("deferred_bind") == Some(&serde_json::Value::Bool(true));
    kit.report.deferred = Some(deferred);
    if !deferred {
        plain_rules(kit).await;
        kit.report.push(
            "deferred_bind",
            false,
            "fingerprint has no \"deferred_bind\": true: a plain Nomad DHV plugin; dhv-binder never publishes with it",
        );
        for r in [
            "publish x10",
            "unpublish x10",
            "data kept across publishes",
            "unpublish of nothing",
            "publish to occupied target",
            "read-only publish",
            "mount flags",
            "unpublish while in use",
            "concurrent calls",
            "killed by the timeout",
            "helper outlives the caller",
        ] {
            kit.report.skip(r, "not deferred");
        }
        output_rules(kit).await;
        return;
    }
    kit.report.push(
        "deferred_bind",
        true,
        "fingerprint says \"deferred_bind\": true",
    );
    storage::capabilities_rule(kit, &fp);
    placement::fields_rule(kit, &fp);
    if kit.report.wants("JSON input parsed") {
        storage::json_input_rule(kit).await;
    }

    // create x10: same answer each time (once, for the rules that need a volume, when
    // another rule is asked for with `-rule`).
    let env = environment::create_env(&kit.node, &kit.rec);
    let mut contexts = Vec::new();
    let mut errors = Vec::new();
    let creates = if kit.report.wants("create x10") {
        REPEAT
    } else {
        1
    };
    for i in 0..creates {
        let c = kit.call(Operation::Create, &env).await;
        match c
            .result
            .as_ref()
            .map_err(|e| e.report())
            .and_then(|o| strict_object(o))
        {
            Ok(v) => contexts.push(v.get("context").cloned().unwrap_or_default()),
            Err(e) => errors.push(format!("call {}: {e}", i + 1)),
        }
    }
    let same = contexts.windows(2).all(|w| w[0] == w[1]);
    kit.report.push(
        "create x10",
        errors.is_empty() && same,
        if !errors.is_empty() {
            joined(&errors)
        } else if !same {
            format!("contexts differ between calls: {:?}", contexts)
        } else {
            format!("10 successes, same context each time: {}", contexts[0])
        },
    );
    let Some(ctx) = contexts.first().cloned() else {
        return;
    };
    kit.rec.context = ctx;

    if [
        "publish x10",
        "owner and mode",
        "unpublish x10",
        "data kept across publishes",
    ]
    .iter()
    .any(|r| kit.report.wants(r))
    {
        // publish x10 onto one target: one mount, never stacked.
        let t1 = kit.target("t1");
        let mut errors = Vec::new();
        let mut pctx = serde_json::Value::Null;
        for i in 0..REPEAT {
            match kit.publish(&t1, false).await {
                Ok(c) => pctx = c,
                Err(e) => errors.push(format!("call {}: {e}", i + 1)),
            }
        }
        let n = mount_count(&t1);
        kit.report.push(
            "publish x10",
            errors.is_empty() && n == 1,
            if errors.is_empty() {
                format!(
                    "10 successes; {} mount entry at the target (stacked mounts would show more)",
                    n
                )
            } else {
                joined(&errors)
            },
        );
        storage::owner_rule(kit, &t1);
        // A marker written through this publish must be read through the next one.
        let marker = format!("conformance-{}", uuid::Uuid::new_v4());
        let wrote = std::fs::write(t1.join(&marker), &marker).map_err(|e| e.to_string());

        // unpublish x10.
        let mut errors = Vec::new();
        for i in 0..REPEAT {
            if let Err(e) = kit.unpublish(&t1, &pctx).await {
                errors.push(format!("call {}: {e}", i + 1));
            }
        }
        kit.report.push(
            "unpublish x10",
            errors.is_empty(),
            if errors.is_empty() {
                "10 successes; the target is not a mount point".to_string()
            } else {
                joined(&errors)
            },
        );

        // Data kept: publish again and read the marker.
        let kept = match (&wrote, kit.publish(&t1, false).await) {
            (Err(e), _) => Err(format!("cannot write through the publish: {e}")),
            (Ok(()), Err(e)) => Err(format!("publish again failed: {e}")),
            (Ok(()), Ok(c)) => {
                pctx = c;
                match std::fs::read_to_string(t1.join(&marker)) {
                    Ok(t) if t == marker => Ok(()),
                    Ok(t) => Err(format!("the file came back as {t:?}")),
                    Err(e) => Err(format!(
                        "the file written through the last publish is gone: {e}"
                    )),
                }
            }
        };
        let _ = std::fs::remove_file(t1.join(&marker));
        let cleanup = kit.unpublish(&t1, &pctx).await;
        kit.report.push(
            "data kept across publishes",
            kept.is_ok() && cleanup.is_ok(),
            match (kept, cleanup) {
                (Ok(()), Ok(())) => {
                    format!("{marker} written, unpublished, published again, read back")
                }
                (Err(e), _) | (_, Err(e)) => e,
            },
        );
    }

    // A helper must outlive the caller's cgroup (Nomad kills the agent's on every upgrade).
    if kit.report.wants("helper outlives the caller") {
        helpers::helper_rule(kit).await;
    }

    if kit.report.wants("unpublish of nothing") {
        // Unpublish of nothing: a target never published, and a missing target.
        let never = kit.target("never");
        let _ = std::fs::create_dir_all(&never);
        let missing = kit.target("missing");
        let a = kit.unpublish(&never, &serde_json::Value::Null).await;
        let b = kit.unpublish(&missing, &serde_json::Value::Null).await;
        kit.report.push(
            "unpublish of nothing",
            a.is_ok() && b.is_ok(),
            format!(
                "unmounted target: {}; missing target: {}",
                a.map(|_| "success".to_string()).unwrap_or_else(|e| e),
                b.map(|_| "success".to_string()).unwrap_or_else(|e| e)
            ),
        );
    }

    if kit.report.wants("publish to occupied target") {
        // Publish onto a target that something else is mounted on: must fail, leave it alone.
        let busy = kit.target("occupied");
        let _ = std::fs::create_dir_all(&busy);
        match nix::mount::mount(
            Some("tmpfs"),
            &busy,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        ) {
            Err(e) => kit.report.push(
                "publish to occupied target",
                false,
                format!("cannot mount a tmpfs to test with: {e}"),
            ),
            Ok(()) => {
                let _ = std::fs::write(busy.join("someone-else"), "x");
                let env = kit.publish_env(&busy, false);
                let c = kit.call(Operation::Publish, &env).await;
                let intact = mount_count(&busy) == 1 && busy.join("someone-else").exists();
                let _ = nix::mount::umount2(&busy, nix::mount::MntFlags::MNT_DETACH);
                kit.report.push(
                    "publish to occupied target",
                    !c.ok() && intact,
                    format!(
                        "publish onto a foreign tmpfs: {}; the tmpfs {}",
                        c.describe(),
                        if intact {
                            "was left alone"
                        } else {
                            "was covered or changed"
                        }
                    ),
                );
                // A plugin that wrongly succeeded may have stacked a mount: undo it.
                while crate::node::mounts::is_mount_point(&busy) {
                    if nix::mount::umount2(&busy, nix::mount::MntFlags::MNT_DETACH).is_err() {
                        break;
                    }
                }
            }
        }
    }

    if kit.report.wants("read-only publish") {
        // Read-only publish.
        let ro = kit.target("ro");
        let verdict = match kit.publish(&ro, true).await {
            Err(e) => Err(e),
            Ok(c) => {
                let w = std::fs::write(ro.join("must-fail"), "x");
                let r = kit.unpublish(&ro, &c).await;
                match (w, r) {
                    (Err(e), Ok(()))
                        if e.raw_os_error() == Some(nix::errno::Errno::EROFS as i32) =>
                    {
                        Ok(format!("writing failed as it must: {e}"))
                    }
                    (Ok(()), _) => Err("a file could be written with DHV_READ_ONLY=true".into()),
                    (Err(e), Ok(())) => Err(format!("writing failed, but not with EROFS: {e}")),
                    (_, Err(e)) => Err(e),
                }
            }
        };
        let ok = verdict.is_ok();
        kit.report
            .push("read-only publish", ok, verdict.unwrap_or_else(|e| e));
    }

    if kit.report.wants("mount flags") {
        mount_flags_rule(kit).await;
    }

    if kit.report.wants("unpublish while in use") {
        // Unpublish while in use: a file held open inside the volume makes the unmount fail
        // (EBUSY); the plugin must report failure and leave the filesystem mounted, never
        // detach it lazily (a lazily detached filesystem lives on, written by its holders,
        // while the volume is published elsewhere).
        let held = kit.target("in-use");
        let verdict = match kit.publish(&held, false).await {
            Err(e) => Err(format!("publish failed: {e}")),
            Ok(c) => {
                let file = std::fs::File::create(held.join("held-open"));
                let env = kit.unpublish_env(&held, &c);
                let call = kit.call(Operation::Unpublish, &env).await;
                let still = crate::node::mounts::MountTable::read_self()
                    .map(|t| t.contains(&held))
                    .map_err(|e| e.to_string());
                drop(file);
                let released = kit.unpublish(&held, &c).await;
                match (call.ok(), still, released) {
                (false, Ok(true), Ok(())) => Ok(format!(
                    "with a file open inside: {}; the target stayed mounted; unpublished once the file was closed",
                    call.describe()
                )),
                (true, still, _) => Err(format!(
                    "unpublish reported success with a file open inside the volume (target {}): it must fail, not detach lazily",
                    if still.unwrap_or(false) { "still mounted" } else { "detached" }
                )),
                (false, Ok(false), _) => Err(format!(
                    "unpublish failed ({}) but the target is no longer mounted: a filesystem in use must stay mounted",
                    call.describe()
                )),
                (false, Err(e), _) => Err(e),
                (false, Ok(true), Err(e)) => Err(format!("unpublish after closing the file: {e}")),
            }
            }
        };
        let ok = verdict.is_ok();
        kit.report
            .push("unpublish while in use", ok, verdict.unwrap_or_else(|e| e));
    }

    if kit.report.wants("concurrent calls") {
        // Concurrent calls on one volume (the agent never does this on one node, but Nomad
        // asks plugins to be safe to call concurrently per volume).
        let t2 = kit.target("concurrent");
        let _ = std::fs::create_dir_all(&t2);
        let env = kit.publish_env(&t2, false);
        let runner = kit.runner.clone();
        let id = kit.plugin_id.clone();
        let secrets = kit.rec.secrets.clone();
        let pubs = futures_util::future::join_all((0..4).map(|_| {
            let (runner, id, env, secrets) =
                (runner.clone(), id.clone(), env.clone(), secrets.clone());
            async move { runner.call(&id, Operation::Publish, &env, &secrets).await }
        }))
        .await;
        let pub_ok = pubs.iter().filter(|r| r.is_ok()).count();
        let stacked = mount_count(&t2);
        let uenv = kit.unpublish_env(&t2, &serde_json::Value::Null);
        let unpubs = futures_util::future::join_all((0..4).map(|_| {
            let (runner, id, env, secrets) =
                (runner.clone(), id.clone(), uenv.clone(), secrets.clone());
            async move { runner.call(&id, Operation::Unpublish, &env, &secrets).await }
        }))
        .await;
        kit.calls += 8;
        let unpub_ok = unpubs.iter().filter(|r| r.is_ok()).count();
        let left = crate::node::mounts::is_mount_point(&t2);
        kit.report.push(
        "concurrent calls",
        pub_ok == 4 && stacked == 1 && unpub_ok == 4 && !left,
        format!(
            "4 concurrent publishes: {pub_ok} succeeded, {stacked} mount entr{} at the target; 4 concurrent unpublishes: {unpub_ok} succeeded, target {}",
            if stacked == 1 { "y" } else { "ies" },
            if left { "STILL MOUNTED" } else { "unmounted" }
        ) + &{
            // The failing calls' own words, each way of failing once.
            let errors: Vec<String> = pubs
                .iter()
                .map(|r| ("publish", r))
                .chain(unpubs.iter().map(|r| ("unpublish", r)))
                .filter_map(|(op, r)| r.as_ref().err().map(|e| format!("{op}: {}", e.report())))
                .collect();
            let errors = counted(&errors);
            if errors.is_empty() {
                String::new()
            } else {
                format!("; {}", errors.join("; "))
            }
        },
    );
        while crate::node::mounts::is_mount_point(&t2) {
            if nix::mount::umount2(&t2, nix::mount::MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
    }

    if kit.report.wants("killed by the timeout") {
        // Calls killed by the timeout (SIGTERM, then SIGKILL of the process group), then retried:
        // the retry must repair whatever state the killed call left.
        let t3 = kit.target("killed");
        let mut notes = Vec::new();
        let mut ok = true;
        for kill_ms in [5u64, 50, 200] {
            let short_runner = Runner::new(kit.runner.plugin_dir(), Duration::from_millis(kill_ms))
                .with_allowed_roots(kit.allowed.clone());
            let _ = std::fs::create_dir_all(&t3);
            let env = kit.publish_env(&t3, false);
            let c = kit.call_with(&short_runner, Operation::Publish, &env).await;
            let timed_out = matches!(c.result, Err(PluginError::TimedOut { .. }));
            let retry = kit.publish(&t3, false).await;
            let once = mount_count(&t3) == 1;
            let ctx = retry.clone().unwrap_or_default();
            let env = kit.unpublish_env(&t3, &ctx);
            let u = kit
                .call_with(&short_runner, Operation::Unpublish, &env)
                .await;
            let u_timed_out = matches!(u.result, Err(PluginError::TimedOut { .. }));
            let u_retry = kit.unpublish(&t3, &ctx).await;
            let good = retry.is_ok() && once && u_retry.is_ok();
            ok &= good;
            notes.push(format!(
                "killed at {kill_ms} ms: publish {} → retry {}{}, unpublish {} → retry {}",
                if timed_out {
                    "killed"
                } else {
                    "finished first"
                },
                match &retry {
                    Ok(_) => "ok".to_string(),
                    Err(e) => e.clone(),
                },
                if once { "" } else { " (mount stacked)" },
                if u_timed_out {
                    "killed"
                } else {
                    "finished first"
                },
                match &u_retry {
                    Ok(()) => "ok".to_string(),
                    Err(e) => e.clone(),
                },
            ));
        }
        kit.report
            .push("killed by the timeout", ok, notes.join("; "));
    }

    // An unpublish with the storage unreachable and a write only in the plugin's cache.
    if kit.report.wants("unpublish that cannot flush") {
        flush::unflushed_unpublish_rule(kit).await;
    }

    // Optional operations (when declared), then confinement, while the volume exists.
    storage::optional_rules(kit).await;
    health::rules(kit).await;
    if kit.report.wants("paths confined") {
        storage::confinement_rule(kit).await;
    }
    if kit.report.wants("symlink race") {
        race::race_rule(kit).await;
    }

    // delete x10 (once, to clean up, when another rule is asked for with `-rule`), then
    // delete of a volume that never existed.
    let denv = environment::delete_env(&kit.node, &kit.rec);
    let mut errors = Vec::new();
    let deletes = if kit.report.wants("delete x10") {
        REPEAT
    } else {
        1
    };
    for i in 0..deletes {
        let c = kit.call(Operation::Delete, &denv).await;
        if let Err(e) = c.result {
            errors.push(format!("call {}: {}", i + 1, e.report()));
        }
    }
    kit.report.push(
        "delete x10",
        errors.is_empty(),
        if errors.is_empty() {
            "10 successes".to_string()
        } else {
            joined(&errors)
        },
    );
    if kit.report.wants("delete of nothing") {
        let mut ghost = kit.rec.clone();
        ghost.id = uuid::Uuid::new_v4().to_string();
        ghost.context = serde_json::Value::Null;
        let genv = environment::delete_env(&kit.node, &ghost);
        let c = kit.call(Operation::Delete, &genv).await;
        kit.report.push(
            "delete of nothing",
            c.ok(),
            format!(
                "delete of a volume never created (context null): {}",
                c.describe()
            ),
        );
    }

    placement::classes_rule(kit);
    output_rules(kit).await;
}

/// Nomad's plain contract: create prints `{"path","bytes"}`, delete gets DHV_CREATED_PATH.
async fn plain_rules(kit: &mut Kit) {
    let env = environment::create_env(&kit.node, &kit.rec);
    let mut paths = Vec::new();
    let mut errors = Vec::new();
    for i in 0..REPEAT {
        let c = kit.call(Operation::Create, &env).await;
        match c
            .result
            .as_ref()
            .map_err(|e| e.report())
            .and_then(|o| strict_object(o))
        {
            Ok(v) => match v.get("path").and_then(|p| p.as_str()) {
                Some(p) if p.starts_with('/') => paths.push(p.to_string()),
                _ => errors.push(format!("call {}: no absolute \"path\" in {v}", i + 1)),
            },
            Err(e) => errors.push(format!("call {}: {e}", i + 1)),
        }
    }
    let same = paths.windows(2).all(|w| w[0] == w[1]);
    kit.report.push(
        "create x10 (Nomad contract)",
        errors.is_empty() && same,
        if !errors.is_empty() {
            joined(&errors)
        } else if !same {
            format!("paths differ: {paths:?}")
        } else {
            format!("10 successes, same path each time: {}", paths[0])
        },
    );
    let created = paths.first().cloned().unwrap_or_default();
    let mut denv = environment::delete_env(&kit.node, &kit.rec);
    denv.retain(|(k, _)| k != "DHV_CREATED_PATH");
    denv.push(("DHV_CREATED_PATH".into(), created));
    let mut errors = Vec::new();
    for i in 0..REPEAT {
        if let Err(e) = kit.call(Operation::Delete, &denv).await.result {
            errors.push(format!("call {}: {}", i + 1, e.report()));
        }
    }
    kit.report.push(
        "delete x10 (Nomad contract)",
        errors.is_empty(),
        if errors.is_empty() {
            "10 successes".to_string()
        } else {
            joined(&errors)
        },
    );
}

/// Unknown operations are refused; every output so far had the right shape; timing.
async fn output_rules(kit: &mut Kit) {
    let started = Instant::now();
    let path = kit.runner.path_of(&kit.plugin_id).unwrap_or_default();
    let unknown = tokio::time::timeout(
        kit.opts.timeout,
        tokio::process::Command::new(&path)
            .arg("no-such-operation")
            .env_clear()
            .env("DHV_OPERATION", "no-such-operation")
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await;
    let evidence = match &unknown {
        Ok(Ok(o)) => format!(
            "exit {}, stdout {}",
            o.status
                .code()
                .map(|c| c.to_string())
                .unwrap_or("by signal".into()),
            short(&String::from_utf8_lossy(&o.stdout))
        ),
        Ok(Err(e)) => format!("cannot run: {e}"),
        Err(_) => format!("no answer within {:?}", started.elapsed()),
    };
    let refused = matches!(&unknown, Ok(Ok(o)) if !o.status.success());
    kit.report
        .push("unknown operation refused", refused, evidence);
    let bad = counted(&std::mem::take(&mut kit.bad_outputs));
    kit.report.push(
        "output shape",
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "{} calls: every success printed one JSON object (or nothing), every failure {{\"error\":\"…\"}}",
                kit.calls
            )
        } else {
            bad.join("; ")
        },
    );
    let holders = counted(&std::mem::take(&mut kit.output_holders));
    kit.report.push(
        "helpers do not hold the output",
        holders.is_empty(),
        if holders.is_empty() {
            format!(
                "{} calls: no process the plugin started kept its stdout or stderr open",
                kit.calls
            )
        } else {
            format!(
                "processes outside the call's group still held its stdout or stderr when the plugin exited (start helpers with </dev/null >/dev/null 2>&1): {}",
                holders.join("; ")
            )
        },
    );
    let limit = kit.opts.timeout;
    let summary: Vec<String> = kit
        .report
        .timings
        .iter()
        .map(|(op, v)| {
            format!(
                "{op} median {} ms max {} ms",
                median(v),
                v.iter().max().unwrap_or(&0)
            )
        })
        .collect();
    let slow: Vec<String> = kit
        .report
        .timings
        .iter()
        .filter(|(_, v)| v.iter().any(|ms| Duration::from_millis(*ms) >= limit))
        .map(|(op, _)| op.to_string())
        .collect();
    kit.report.push(
        "within the timeout",
        slow.is_empty(),
        if slow.is_empty() {
            format!("limit {limit:?}: {}", summary.join(", "))
        } else {
            format!(
                "calls reached the {limit:?} timeout: {}; {}",
                slow.join(", "),
                summary.join(", ")
            )
        },
    );
}

/// The flags of the published mount, from the kernel's mount table (never the plugin's
/// word): a publish without `mount_options` carries `nosuid,nodev`, one of a volume whose
/// spec asks `mount_flags = ["noexec"]` carries `noexec,nosuid,nodev` (`DHV_MOUNT_FLAGS`)
/// or is refused (a plugin that cannot apply a flag fails the publish; one that succeeds
/// without it fails the rule).
async fn mount_flags_rule(kit: &mut Kit) {
    let mut verdicts = Vec::new();
    let mut ok = true;
    for (name, asked) in [
        ("flags-default", &[][..]),
        ("flags-noexec", &["noexec"][..]),
    ] {
        let mut rec = kit.rec.clone();
        rec.spec.mount_options =
            match MountOptions::new(asked.iter().map(|s| s.to_string()).collect(), String::new()) {
                Ok(m) => m,
                Err(e) => {
                    ok = false;
                    verdicts.push(format!("{asked:?}: {e}"));
                    continue;
                }
            };
        let want = rec.spec.mount_options.flags().to_list();
        let target = kit.target(name);
        let published = kit.publish_rec(&rec, &target, false).await;
        let verdict = match &published {
            // A plugin may refuse a flag it cannot apply: nothing is published without it.
            Err(e) if !asked.is_empty() => Ok(format!(
                "DHV_MOUNT_FLAGS={want}: refused ({e}); nothing published without the flags"
            )),
            Err(e) => Err(format!("publish with DHV_MOUNT_FLAGS={want}: {e}")),
            Ok(_) => match crate::node::mounts::MountTable::read_self() {
                Err(e) => Err(e.to_string()),
                Ok(t) => match t.top_at(&target) {
                    None => Err(format!("nothing mounted at {}", target.display())),
                    Some(m) => {
                        let have: Vec<&str> = m.options().split(',').collect();
                        let missing: Vec<&str> =
                            want.split(',').filter(|f| !have.contains(f)).collect();
                        if missing.is_empty() {
                            Ok(format!(
                                "DHV_MOUNT_FLAGS={want}: the mount table shows {}",
                                m.options()
                            ))
                        } else {
                            Err(format!(
                                "DHV_MOUNT_FLAGS={want}, but the mount table shows {} (missing {})",
                                m.options(),
                                missing.join(",")
                            ))
                        }
                    }
                },
            },
        };
        if let Ok(c) = published {
            if let Err(e) = kit.unpublish_rec(&rec, &target, &c).await {
                ok = false;
                verdicts.push(format!("unpublish: {e}"));
            }
        }
        ok &= verdict.is_ok();
        verdicts.push(verdict.unwrap_or_else(|e| e));
    }
    kit.report.push("mount flags", ok, verdicts.join("; "));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(only: &[&str], skip: &[&str]) -> Options {
        Options {
            plugin: "/nonexistent/plugin".into(),
            parameters: BTreeMap::new(),
            secrets: BTreeMap::new(),
            capacity: 64 << 20,
            timeout: Duration::from_secs(1),
            scratch: None,
            roots: Vec::new(),
            cgroup: None,
            only: only.iter().map(|s| s.to_string()).collect(),
            skip: skip.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[tokio::test]
    async fn a_rule_named_wrongly_or_that_others_need_is_refused_before_anything_runs() {
        let e = check(options(&["symlink races"], &[])).await.unwrap_err();
        assert!(
            matches!(&e, CheckError::UnknownRule(r) if r == "symlink races"),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("the rules: fingerprint, deferred_bind"),
            "{e}"
        );
        let e = check(options(&[], &["create x10"])).await.unwrap_err();
        assert!(
            matches!(&e, CheckError::NotSkippable(r) if r == "create x10"),
            "{e}"
        );
    }

    #[test]
    fn evidence_that_repeats_is_said_once_with_a_count() {
        let e = |s: &str| s.to_string();
        let got = counted(&[e("a"), e("b"), e("a"), e("a")]);
        assert_eq!(got, vec![e("a (x3)"), e("b")]);
    }
}
