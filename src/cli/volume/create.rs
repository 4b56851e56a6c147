//! `volume create` and `volume register`: the spec read and checked, the record written
//! (signed), and the wait for the node that runs the plugin's create.

use super::super::output::{bytes, plugin_text};
use super::super::records::read_record;
use super::super::storage::{self, LocalPlugins};
use super::super::{Failure, EXIT_CONFIG, EXIT_FAILED, EXIT_TIMEOUT};
use super::eligibility::{no_eligible_node, node_name, why_waiting};
use crate::cluster::nodes;
use crate::cluster::trust::SigningKey;
use crate::escape::escape_control;
use crate::nomad::{Client, NomadError};
use crate::volume::{self, VolumeRecord, VolumeState};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Reads a spec file, or standard input for `-` (as `nomad volume create -` does).
fn read_spec_text(path: &Path) -> Result<String, Failure> {
    if path == Path::new("-") {
        use std::io::Read as _;
        let mut text = String::new();
        std::io::stdin()
            .take(volume::MAX_SPEC_BYTES as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|e| {
                Failure::new(EXIT_CONFIG, format!("cannot read the spec from stdin: {e}"))
            })?;
        return Ok(text);
    }
    std::fs::read_to_string(path)
        .map_err(|e| Failure::new(EXIT_CONFIG, format!("cannot read {}: {e}", path.display())))
}

/// How a spec's errors name it: the path as the user gave it, or `<stdin>` for `-`.
fn spec_source(path: &Path) -> String {
    if path == Path::new("-") {
        "<stdin>".into()
    } else {
        path.display().to_string()
    }
}

/// Parses a spec (a register spec with `register`) read from `source` (as
/// [`spec_source`] names it), taking the CLI's namespace when the spec names none. An error
/// names the file and the line: `spec.hcl:7: …`.
fn parse(
    source: &str,
    text: &str,
    ns: &str,
    register: bool,
) -> Result<(volume::VolumeSpec, BTreeMap<String, String>), Failure> {
    let parsed = if register {
        volume::parse_register_spec(text)
    } else {
        volume::parse_spec(text)
    };
    let (mut spec, secrets) = parsed.map_err(|e| {
        let mut message = e.located(source, text);
        // The parser notices a block left open only at the end of the file: name the line
        // that opened it.
        if message.contains("expected `}`") {
            if let Some(line) = unclosed_block(text) {
                message.push_str(&format!(" (the block opened on line {line} is not closed)"));
            }
        }
        Failure::new(EXIT_CONFIG, message)
    })?;
    if spec.namespace == "default" && ns != "default" && ns != "*" && !text.contains("namespace") {
        spec.namespace = ns.to_string();
    }
    Ok((spec, secrets))
}

/// The line (1-based) of the last `{` in `text` that no `}` closes, outside strings and
/// comments; `None` when every block is closed.
pub fn unclosed_block(text: &str) -> Option<usize> {
    let mut open: Vec<usize> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut in_string = false;
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' if in_string => {
                    chars.next();
                }
                '"' => in_string = !in_string,
                '#' if !in_string => break,
                '/' if !in_string && chars.peek() == Some(&'/') => break,
                '{' if !in_string => open.push(n + 1),
                '}' if !in_string => {
                    open.pop();
                }
                _ => {}
            }
        }
    }
    open.last().copied()
}

/// The register-only fields of a spec: `context { ... }` and `capacity`.
#[derive(Debug, Default, serde::Deserialize)]
struct RegisterExtras {
    #[serde(default)]
    context: BTreeMap<String, hcl::Value>,
    capacity: Option<hcl::Value>,
}

/// Reads `context` (as a JSON object of strings and numbers) and `capacity` (bytes, or a
/// size such as `"10GiB"`) from a register spec read from `source`; an error names the file
/// and, for a bad field, its line.
pub fn register_extras(source: &str, text: &str) -> Result<(serde_json::Value, u64), Failure> {
    let at = |field: &str, message: String| {
        let place = match volume::spec_line(text, None, field, None) {
            Some(line) => format!("{source}:{line}"),
            None => source.to_string(),
        };
        Failure::new(EXIT_CONFIG, format!("{place}: {message}"))
    };
    let x: RegisterExtras = hcl::from_str(text).map_err(|e| at("context", e.to_string()))?;
    if x.context.is_empty() {
        return Err(Failure::new(
            EXIT_CONFIG,
            format!("{source}: a register spec needs a `context {{ ... }}` block: what the plugin's create would have returned for this storage (e.g. export_path for the bind plugin; see docs/plugin-protocol.md)"),
        ));
    }
    let context =
        serde_json::to_value(&x.context).map_err(|e| at("context", format!("context: {e}")))?;
    let capacity = match &x.capacity {
        None => 0,
        Some(hcl::Value::Number(n)) => n.as_u64().unwrap_or(0),
        Some(hcl::Value::String(s)) => s
            .trim()
            .parse::<u64>()
            .or_else(|_| s.trim().parse::<bytesize::ByteSize>().map(|b| b.as_u64()))
            .map_err(|_| {
                at(
                    "capacity",
                    format!("capacity {s:?} is not a size (e.g. \"10GiB\")"),
                )
            })?,
        Some(other) => {
            return Err(at(
                "capacity",
                format!("capacity {other} is not a size (e.g. \"10GiB\")"),
            ))
        }
    };
    Ok((context, capacity))
}
/// Writes a new record; refused when the volume exists (Nomad's check-and-set index 0).
async fn put_new(
    client: &Client,
    var: &crate::nomad::types::Variable,
    key: &str,
) -> Result<(), Failure> {
    match crate::cluster::changes::put_record(client, var, Some(0)).await {
        Ok(_) => Ok(()),
        Err(NomadError::CasConflict { .. }) => Err(Failure::new(
            EXIT_FAILED,
            format!("volume {key} already exists"),
        )),
        Err(e) => Err(e.into()),
    }
}
/// `volume create -dry-run`: what a create of `spec` would do, writing nothing: each node
/// with a dhv-binder record and whether it would offer the volume (or why not), the plugin
/// (its versions on those nodes) that would run the create, and what would be refused (a
/// volume that exists, no node to serve it, a source no node can reach, an unsigned record
/// with no key given). Exit 0 when the create would be accepted, 1 when refused.
pub async fn dry_run(
    client: &Client,
    ns: &str,
    spec: &Path,
    local: &LocalPlugins,
    key: Option<&SigningKey>,
) -> Result<(), Failure> {
    let text = read_spec_text(spec)?;
    let (spec, _secrets) = parse(&spec_source(spec), &text, ns, false)?;
    let now = super::super::output::now_unix();
    let mut refused: Vec<String> = Vec::new();
    if !client.namespace_exists(&spec.namespace).await? {
        refused.push(format!(
            "namespace {:?} does not exist in Nomad (`nomad namespace apply {}`)",
            spec.namespace, spec.namespace
        ));
    }
    if let Some(var) = client
        .variable(&spec.namespace, &volume::record_path(&spec.name))
        .await?
    {
        let state = var.items.get("state").cloned().unwrap_or_default();
        refused.push(format!(
            "volume {}/{} exists ({state}): a create of it would grow it or run its failed create again, nothing else (`dhv-binder volume status {}`)",
            spec.namespace, spec.name, spec.name
        ));
    }
    if let Err(e) = storage::check_source(client, &spec, local).await {
        refused.push(e.message);
    }
    let (records, bad) = nodes::list(client).await?;
    for e in bad {
        eprintln!("warning: {e}");
    }
    if let Some(why) = no_eligible_node(&records, &spec.plugin_id, &spec.node_pool, now) {
        refused.push(why);
    }
    if let Some(why) = super::eligibility::no_topology_node(&records, &spec, now) {
        refused.push(why);
    }
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            let why = super::eligibility::why_not(r, &spec.plugin_id, &spec.node_pool, now);
            vec![
                r.node_name.clone(),
                r.node_pool.clone(),
                match &why {
                    None => "offers it".into(),
                    Some(w) => format!("no: {w}"),
                },
                r.plugins
                    .get(&spec.plugin_id)
                    .map(|p| p.version.clone())
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let serving: Vec<&str> = records
        .iter()
        .filter(|r| r.can_serve(&spec.plugin_id, &spec.node_pool, now))
        .map(|r| r.node_name.as_str())
        .collect();
    outln!(
        "==> Dry run of the create of {}/{} (nothing is written)",
        spec.namespace,
        spec.name
    );
    outln!(
        "    Plugin {:?} would run the create on {}",
        spec.plugin_id,
        if serving.is_empty() {
            "no node".to_string()
        } else {
            format!(
                "one of: {} (the first agent to take the record)",
                serving.join(", ")
            )
        }
    );
    if let Some(note) = access_mode_note(&spec) {
        outln!("    {note}");
    }
    outln!();
    outln!(
        "{}",
        super::super::output::table(
            &["Node", "Pool", "Offers The Volume", "Plugin Version"],
            &rows,
            "No node has published a dhv-binder record",
        )
        .trim_end()
    );
    outln!();
    if refused.is_empty() {
        outln!(
            "==> The create would be accepted{}",
            if key.is_none() {
                " (unsigned: see the warning above)"
            } else {
                ""
            }
        );
        return Ok(());
    }
    for r in &refused {
        outln!("    - {r}");
    }
    Err(Failure::new(
        EXIT_FAILED,
        format!(
            "the create would be refused ({} reason{}); nothing was written",
            refused.len(),
            if refused.len() == 1 { "" } else { "s" }
        ),
    ))
}

/// `volume create`: a new record (or the re-run of a failed create, or an expansion of an
/// existing volume), then the wait for the agents unless `wait` is `None` (`-detach`).
pub async fn create(
    client: &Client,
    ns: &str,
    spec: &Path,
    wait: Option<Duration>,
    local: &LocalPlugins,
    key: Option<SigningKey>,
) -> Result<(), Failure> {
    let text = read_spec_text(spec)?;
    let (spec, secrets) = parse(&spec_source(spec), &text, ns, false)?;
    if !client.namespace_exists(&spec.namespace).await? {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "namespace {:?} does not exist in Nomad, which creates none on demand (jobs and host volumes in it would be refused): create it first (`nomad namespace apply {}`) or name another in the spec",
                spec.namespace, spec.namespace
            ),
        ));
    }
    let existing = match client
        .variable(&spec.namespace, &volume::record_path(&spec.name))
        .await?
    {
        Some(_) => Some(read_record(client, &spec.namespace, &spec.name).await?),
        None => None,
    };
    let rerun = match existing {
        Some(cur) if cur.state == VolumeState::Failed => Some(cur),
        Some(cur) if matches!(cur.state, VolumeState::Pending | VolumeState::Creating) => {
            if !matches!(
                crate::cluster::expansion::plan_update(&cur, &spec),
                Ok(crate::cluster::expansion::Update::Unchanged)
            ) {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} is still being created with another spec: wait for it, or delete it (`dhv-binder volume delete {}`) and create it again",
                        cur.key(),
                        cur.spec.name
                    ),
                ));
            }
            // A pending record no node has taken, with the operator's key: signed again (the
            // fix a node's "not signed" or "key … not trusted" refusal names).
            let resigned = match &key {
                Some(k) if cur.state == VolumeState::Pending && cur.worker_node.is_empty() => {
                    super::super::records::resign_pending(client, &cur, k).await?
                }
                _ => None,
            };
            match resigned {
                Some((_, line)) => outln!("{line}"),
                None => outln!(
                    "==> Volume {} is already being created ({})",
                    cur.key(),
                    cur.state.as_str()
                ),
            }
            return match wait {
                None => Ok(()),
                Some(w) => wait_created(client, &cur, w).await,
            };
        }
        Some(_) => return storage::create_existing(client, &spec, wait, local, key.as_ref()).await,
        None => None,
    };
    storage::check_source(client, &spec, local).await?;
    let (records, bad) = nodes::list(client).await?;
    for e in bad {
        eprintln!("warning: {e}");
    }
    if let Some(why) = no_eligible_node(
        &records,
        &spec.plugin_id,
        &spec.node_pool,
        super::super::output::now_unix(),
    ) {
        return Err(Failure::new(EXIT_FAILED, why));
    }
    let now = super::super::output::now_unix();
    if let Some(why) = super::eligibility::no_topology_node(&records, &spec, now) {
        return Err(Failure::new(EXIT_FAILED, why));
    }
    let mut rec = VolumeRecord::new(spec, secrets);
    if let Some(old) = &rerun {
        // A failed create made no storage (the plugin said so): the same volume (its ID
        // kept, as Nomad keeps a volume's ID) is created again, with the spec as given now.
        if key.is_none() && !old.signature.is_empty() {
            return Err(Failure::new(
                EXIT_CONFIG,
                format!("volume {} is signed: give the operator's key (--signing-key or DHV_BINDER_SIGNING_KEY) to create it again", old.key()),
            ));
        }
        rec.id = old.id.clone();
        rec.modify_index = old.modify_index;
        outln!(
            "==> Volume {} failed to be created before ({}); running its create again",
            old.key(),
            escape_control(&plugin_text(&old.error))
        );
    }
    // A clone is made where its source is mounted, so the plugin can quiesce it (or where
    // its storage is reachable when it is mounted nowhere), by a node of the clone's pool.
    if let Some(on) = storage::source_node(client, &rec.spec).await? {
        let now = super::super::output::now_unix();
        let serves = |id: &str| {
            records.iter().any(|r| {
                r.node_id == id && r.can_serve(&rec.spec.plugin_id, &rec.spec.node_pool, now)
            })
        };
        if on.node_id.is_empty() || serves(&on.node_id) {
            outln!("==> The clone is made on {}", on.describe());
            rec.worker_node = on.node_id;
        }
    }
    if let Some(k) = &key {
        k.sign(&mut rec);
    }
    rec.check_size()
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    if rerun.is_some() {
        match crate::cluster::changes::put_record(
            client,
            &rec.to_variable(),
            Some(rec.modify_index),
        )
        .await
        {
            Ok(_) => {}
            Err(NomadError::CasConflict { .. }) => {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!("volume {} changed meanwhile; try again", rec.key()),
                ))
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        put_new(client, &rec.to_variable(), &rec.key().to_string()).await?;
    }
    outln!(
        "==> Created volume record {} (ID {}), plugin {:?}",
        rec.key(),
        rec.id,
        rec.spec.plugin_id
    );
    if let Some(note) = access_mode_note(&rec.spec) {
        outln!("    {note}");
    }
    match wait {
        None => Ok(()),
        Some(w) => {
            outln!(
                "    Waiting for a node with plugin {:?} to run its create…",
                rec.spec.plugin_id
            );
            wait_created(client, &rec, w).await
        }
    }
}

/// What a job must request for a volume whose first capability is a multi-node mode:
/// Nomad's host volumes know single-node modes only, so each node's placeholder offers the
/// single-node counterpart, and a job asking for the multi-node mode is never placed.
/// `None` for single-node modes.
pub fn access_mode_note(spec: &volume::VolumeSpec) -> Option<String> {
    let mode = spec.capabilities.first()?.access_mode.as_str();
    let single = match mode {
        "multi-node-multi-writer" => "single-node-multi-writer",
        "multi-node-reader-only" => "single-node-reader-only",
        _ => return None,
    };
    Some(format!(
        "Note: jobs request this {mode} volume with access_mode = \"{single}\" (Nomad's host volumes know single-node modes only: each node's placeholder offers {single}; a job asking for {mode} is never placed). Every node may publish it at once."
    ))
}

/// Waits until a recorded create is done: `Ok` once ready; the plugin's error with the
/// node that ran it once failed; after `wait`, exit 75 with why no agent acted.
async fn wait_created(client: &Client, rec: &VolumeRecord, wait: Duration) -> Result<(), Failure> {
    let mut told = String::new();
    let deadline = Instant::now() + wait;
    let mut records = nodes::list(client).await?.0;
    loop {
        let cur = read_record(client, &rec.spec.namespace, &rec.spec.name).await?;
        if !cur.worker_node.is_empty() && cur.worker_node != told {
            if !records.iter().any(|r| r.node_id == cur.worker_node) {
                records = nodes::list(client).await?.0;
            }
            outln!(
                "    Node {} took the create",
                node_name(&records, &cur.worker_node)
            );
            told = cur.worker_node.clone();
        }
        match cur.state {
            VolumeState::Ready => {
                outln!(
                    "==> Volume {} is ready ({})",
                    cur.key(),
                    bytes(cur.capacity_bytes)
                );
                return Ok(());
            }
            VolumeState::Failed => {
                let on = if cur.worker_node.is_empty() {
                    String::new()
                } else {
                    format!(" on node {}", node_name(&records, &cur.worker_node))
                };
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} failed to be created{on}: {}\nFix the cause and run the same `dhv-binder volume create` again to retry (or `dhv-binder volume delete {}`)",
                        cur.key(),
                        escape_control(&plugin_text(&cur.error)),
                        cur.spec.name
                    ),
                ));
            }
            _ if Instant::now() > deadline => {
                let records = nodes::list(client).await?.0;
                let why = why_waiting(&cur, &records, super::super::output::now_unix())
                    .unwrap_or_else(|| {
                        format!(
                            "no agent has reported why: see `dhv-binder plugin status {}` and the agents' logs",
                            cur.spec.plugin_id
                        )
                    });
                return Err(Failure::new(
                    EXIT_TIMEOUT,
                    format!(
                        "volume {} is still {} after {}: {why} (the record stays; `-detach` returns at once)",
                        cur.key(),
                        cur.state.as_str(),
                        humantime::format_duration(wait)
                    ),
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}
/// `volume register`: a ready record for storage that already exists (no plugin create).
pub async fn register(
    client: &Client,
    ns: &str,
    spec: PathBuf,
    key: Option<SigningKey>,
) -> Result<(), Failure> {
    let text = read_spec_text(&spec)?;
    let source = spec_source(&spec);
    let (spec, secrets) = parse(&source, &text, ns, true)?;
    let (context, capacity) = register_extras(&source, &text)?;
    let mut rec = VolumeRecord::new(spec, secrets);
    rec.state = VolumeState::Ready;
    rec.context = context;
    rec.capacity_bytes = capacity;
    // The signature covers the spec, the secrets, the registered mark and this context: the
    // operator's storage path is the one nodes use (docs/security.md).
    rec.registered = true;
    if let Some(k) = &key {
        k.sign(&mut rec);
    }
    rec.check_size()
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    let var = rec.to_variable();
    put_new(client, &var, &rec.key().to_string()).await?;
    outln!(
        "==> Registered volume {} (ID {}), plugin {:?}: ready, no plugin create was run",
        rec.key(),
        rec.id,
        rec.spec.plugin_id
    );
    match nodes::list(client).await {
        Ok((records, _)) => {
            if let Some(why) = no_eligible_node(
                &records,
                &rec.spec.plugin_id,
                &rec.spec.node_pool,
                super::super::output::now_unix(),
            ) {
                eprintln!("warning: jobs using it cannot start yet: {why}");
            }
        }
        Err(e) => eprintln!("warning: cannot read node records: {e}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 37 #12: a multi-node volume says at create which mode jobs request.
    #[test]
    fn a_multi_node_volume_says_which_mode_jobs_request() {
        let spec = |mode: &str| {
            volume::parse_spec(&format!(
                "name = \"v\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"{mode}\"\n}}\n"
            ))
            .unwrap()
            .0
        };
        let note = access_mode_note(&spec("multi-node-multi-writer")).unwrap();
        assert!(
            note.contains("access_mode = \"single-node-multi-writer\""),
            "{note}"
        );
        assert!(access_mode_note(&spec("multi-node-reader-only"))
            .unwrap()
            .contains("\"single-node-reader-only\""));
        assert_eq!(access_mode_note(&spec("single-node-writer")), None);
    }

    /// Issue 46: a block left open is named by the line that opened it, not only the end
    /// of the file where the parser notices it.
    #[test]
    fn an_unclosed_block_names_the_line_that_opened_it() {
        let text = "name = \"x\"\nplugin_id = \"bind\"\ncapability {\n  access_mode = \"single-node-writer\"\n\n\n\nparameters {\n  export = \"/s{rv\"\n}\n";
        assert_eq!(unclosed_block(text), Some(3));
        let e = parse("c.hcl", text, "default", false).unwrap_err();
        assert!(
            e.message
                .contains("(the block opened on line 3 is not closed)"),
            "{}",
            e.message
        );
        assert_eq!(unclosed_block("a {\n  b = \"}\"\n}\n"), None);
    }

    #[test]
    fn a_register_spec_needs_a_context_and_reads_its_capacity() {
        let (ctx, cap) = register_extras(
            "r.hcl",
            "name = \"x\"\nplugin_id = \"bind\"\ncapacity = \"2GiB\"\ncontext {\n  export_path = \"/srv/x\"\n}\n",
        )
        .unwrap();
        assert_eq!(ctx, serde_json::json!({"export_path": "/srv/x"}));
        assert_eq!(cap, 2 << 30);
        let e = register_extras("r.hcl", "name = \"x\"\nplugin_id = \"bind\"\n").unwrap_err();
        assert!(e.message.contains("context"), "{}", e.message);
        // Issue 37 #15: a bad field names the file and its line.
        let e = register_extras(
            "r.hcl",
            "name = \"x\"\nplugin_id = \"bind\"\ncontext {\n  export_path = \"/srv/x\"\n}\ncapacity = \"lots\"\n",
        )
        .unwrap_err();
        assert!(
            e.message.starts_with("r.hcl:6: capacity \"lots\""),
            "{}",
            e.message
        );
    }
}
