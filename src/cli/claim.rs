//! `volume claim release`: the operator's override of a single-node volume's claim (issue
//! 31). It shows who holds the claim (the node, the allocations of it that use the volume,
//! what the node's record says it has mounted), asks for confirmation (`-yes` skips the
//! prompt; without a terminal and without `-yes` it refuses), then writes a release mark
//! signed with the operator's key ([`crate::cluster::claim_release`]) and releases the Nomad
//! lock itself with the lock ID it reads (a management token sees it). Nodes take the claim
//! over only on a mark that verifies with their `--record-keys`. Audited: a warn line here
//! and on the node that takes the claim.
//!
//! Nomad API: `GET /v1/var/:path`, `PUT /v1/var/:path`, `PUT /v1/var/:path?lock-release`,
//! `GET /v1/node/:id`, `GET /v1/node/:id/allocations`.

use super::records::{read_record, SigningArgs};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::cluster::claim_release::ReleaseMark;
use crate::cluster::claims::claim_path;
use crate::cluster::nodes;
use crate::nomad::types::VariableLock;
use crate::nomad::Client;
use crate::volume::VolumeKey;
use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::Duration;

/// `volume claim ...`.
#[derive(Debug, clap::Subcommand)]
pub enum ClaimCommand {
    /// Release a node's claim on a single-node volume so another node may publish it, even
    /// though its holder's node is ready with a live allocation using it (its dhv-binder is
    /// down). Shows the holder and asks first. Two nodes may then write the volume at once
    /// if the holder's task still writes: stop it first (docs/operations/README.md).
    Release {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
        /// Do not ask for confirmation (required without a terminal).
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        key: SigningArgs,
    },
}

/// Runs a `volume claim` subcommand.
pub async fn claim_cmd(client: &Client, ns: &str, cmd: ClaimCommand) -> Result<(), Failure> {
    match cmd {
        ClaimCommand::Release { name, yes, key } => release(client, ns, &name, yes, key).await,
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Why releasing the claim is dangerous now, one line each: the holder's agent is alive (it
/// holds the claim on purpose and keeps the volume mounted), a task of the holder's still
/// runs with the volume (two nodes would write at once). Empty when neither.
pub fn release_warnings(agent_alive: bool, running: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    if agent_alive {
        out.push("the holder's dhv-binder agent is alive (its node record is fresh): it holds the claim because a task there uses the volume; stop that job instead of releasing the claim".to_string());
    }
    if !running.is_empty() {
        out.push(format!(
            "a task on the holder still runs with the volume ({}): after the release another node may publish it while this one writes; stop it first (`nomad alloc stop`)",
            running.join(", ")
        ));
    }
    out
}

/// Who holds the claim, in lines for the operator, and the warnings of
/// [`release_warnings`].
async fn describe_holder(
    client: &Client,
    volume: &VolumeKey,
    holder: &str,
    lock: Option<&VariableLock>,
) -> Result<(Vec<String>, Vec<String>), Failure> {
    let records = nodes::list(client).await?.0;
    let rec = records.iter().find(|r| r.node_id == holder);
    let agent_alive =
        rec.is_some_and(|r| r.liveness(super::output::now_unix()) == nodes::Liveness::Live);
    let mut running = Vec::new();
    let status = client
        .node_status(holder)
        .await?
        .unwrap_or_else(|| "unknown to Nomad".into());
    let mut out = vec![format!(
        "Holder node  = {} ({holder}), {status} in Nomad",
        rec.map(|r| r.node_name.as_str())
            .unwrap_or("no dhv-binder record")
    )];
    out.push(match lock {
        Some(l) if !l.id.is_empty() => format!("Lock         = held, ID {}", l.id),
        _ => "Lock         = not held (lapsed or released; this token may not see it)".into(),
    });
    match rec.and_then(|r| r.volumes.get(&volume.to_string())) {
        Some(v) => out.push(format!(
            "Node reports = {} since {}, used by [{}]{}",
            if v.state.is_empty() {
                "no mount"
            } else {
                &v.state
            },
            super::output::rfc3339(v.since).unwrap_or_else(|| "(unknown)".into()),
            v.users.join(", "),
            if v.error.is_empty() {
                String::new()
            } else {
                format!(", last error: {}", v.error)
            }
        )),
        None => out.push("Node reports = nothing about this volume".into()),
    }
    out.push(
        "Processes    = not reported by node records (check the node itself: `fuser -m <mount>`)"
            .into(),
    );
    if let Ok((allocs, _)) = client.node_allocations(holder, 0, Duration::ZERO).await {
        for a in allocs.value.iter().filter(|a| {
            *a.namespace == *volume.namespace
                && a.group().is_some_and(|g| {
                    g.volumes
                        .values()
                        .any(|r| r.volume_type == "host" && *r.source == *volume.name)
                })
        }) {
            out.push(format!(
                "Allocation   = {} of job {}, {}",
                a.id,
                a.job_id,
                if a.tasks_finished() {
                    "finished"
                } else {
                    "running"
                }
            ));
            if !a.tasks_finished() {
                running.push(format!("allocation {} of job {}", a.id, a.job_id));
            }
        }
    }
    Ok((out, release_warnings(agent_alive, &running)))
}

fn confirm(yes: bool, question: &str) -> Result<(), Failure> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Failure::new(
            EXIT_CONFIG,
            "refusing to release a claim without confirmation: no terminal to ask on; give -yes if you are sure".to_string(),
        ));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    if matches!(line.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(Failure::new(
            EXIT_FAILED,
            "cancelled; the claim is unchanged".to_string(),
        ))
    }
}

async fn release(
    client: &Client,
    ns: &str,
    name: &str,
    yes: bool,
    key: SigningArgs,
) -> Result<(), Failure> {
    let r = read_record(client, ns, name).await?;
    let volume = r.key();
    let Some(claim) = client
        .variable(&volume.namespace, &claim_path(&volume.name))
        .await?
    else {
        outln!("==> Volume {volume} has no claim; nothing to release");
        return Ok(());
    };
    let Some(holder) = claim.items.get("node_id").cloned() else {
        outln!("==> The claim on {volume} names no node; nothing to release");
        return Ok(());
    };
    let key = key.load()?;
    let (lines, warnings) = describe_holder(client, &volume, &holder, claim.lock.as_ref()).await?;
    for line in lines {
        outln!("{line}");
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    confirm(
        yes,
        &format!("Release node {holder}'s claim on {volume}? If its task still writes, two nodes may write the volume at once."),
    )?;
    tracing::warn!(%volume, holder = %holder, "operator releases the claim (`volume claim release`)");
    eprintln!("warning: releasing node {holder}'s claim on {volume} by operator override");
    // Release the lock first: its release changes the claim's ModifyIndex, which the mark
    // names. Until the mark is written, nodes still refuse to take a live holder's claim.
    if let Some(lock) = claim.lock.as_ref().filter(|l| !l.id.is_empty()) {
        crate::cluster::claims::release(client, &volume, &lock.id)
            .await
            .map_err(|e| {
                Failure::new(
                    super::EXIT_UNAVAILABLE,
                    format!("{e}; nothing was released, try again"),
                )
            })?;
    }
    let current = client
        .variable(&volume.namespace, &claim_path(&volume.name))
        .await?
        .ok_or_else(|| {
            Failure::new(
                EXIT_FAILED,
                format!("the claim on {volume} vanished meanwhile; nothing to release"),
            )
        })?;
    if current.items.get("node_id") != Some(&holder) {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "the claim on {volume} changed hands meanwhile (now {:?}); run the command again",
                current.items.get("node_id")
            ),
        ));
    }
    let mut mark = ReleaseMark::new(
        volume.clone(),
        holder.clone(),
        current.modify_index,
        now_ms(),
    );
    if let Some(k) = &key {
        mark.sign(k);
    }
    client.put_variable(&mark.to_variable(), None).await?;
    outln!(
        "==> Released node {holder}'s claim on {volume} (claim index {}); a node waiting for the volume may take it now",
        current.modify_index
    );
    Ok(())
}
