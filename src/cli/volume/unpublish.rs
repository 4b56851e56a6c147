//! `volume unpublish -node N -force [-kill]`: the operator's forced unpublish of a volume on
//! one node. The operator's machine is not the node: the request is written, signed with the
//! operator's key, to the variable the node's agent follows
//! ([`crate::cluster::unpublish_request`]); the node's agent acts on it (killing the
//! processes that hold the mount first with `-kill`, as the fence does) and writes its
//! answer back, which this command waits for. Audited: a warn line here and on the node,
//! and a `forced-unpublish` event in the node's journal and `volume status -verbose`.
//!
//! Nomad API: `GET /v1/var/:path`, `PUT /v1/var/:path?cas=N`, `GET /v1/node/:id/allocations`.

use super::super::records::{read_record, SigningArgs};
use super::super::{Failure, EXIT_CONFIG, EXIT_FAILED, EXIT_TIMEOUT};
use crate::cluster::nodes;
use crate::cluster::unpublish_request::{request_path, RequestState, UnpublishRequest};
use crate::nomad::{Client, NomadError};
use crate::volume::VolumeKey;
use std::time::{Duration, Instant};

/// What `volume unpublish` was given.
#[derive(Debug)]
pub struct UnpublishArgs {
    /// The volume's name, or its ID or a unique prefix of it.
    pub name: String,
    /// The node: its name, or its ID or a unique prefix of it.
    pub node: String,
    /// Unpublish even while allocations on the node run with the volume.
    pub force: bool,
    /// Kill the processes holding the mount instead of refusing.
    pub kill: bool,
    /// How long to wait for the node's answer; `None` with `-detach`.
    pub wait: Option<Duration>,
}

/// The node named `want` among the node records: by name, ID or unique ID prefix.
fn resolve_node(records: &[nodes::NodeRecord], want: &str) -> Result<(String, String), Failure> {
    let found: Vec<&nodes::NodeRecord> = records
        .iter()
        .filter(|n| n.node_name == want || n.node_id.starts_with(want))
        .collect();
    match found[..] {
        [n] => Ok((n.node_id.clone(), n.node_name.clone())),
        [] => Err(Failure::new(
            EXIT_CONFIG,
            format!("no dhv-binder node record has the name or ID prefix {want:?} (`dhv-binder node status` lists them)"),
        )),
        _ => Err(Failure::new(
            EXIT_CONFIG,
            format!(
                "{want:?} matches {} nodes ({}): give more of the ID",
                found.len(),
                found
                    .iter()
                    .map(|n| format!("{} {}", n.node_name, n.node_id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// The allocations on `node` whose tasks run with `volume`, as `allocation <id> of job <job>`.
async fn running_on(
    client: &Client,
    node: &str,
    volume: &VolumeKey,
) -> Result<Vec<String>, Failure> {
    let (allocs, _) = client.node_allocations(node, 0, Duration::ZERO).await?;
    Ok(allocs
        .value
        .iter()
        .filter(|a| {
            *a.namespace == *volume.namespace
                && !a.tasks_finished()
                && a.group().is_some_and(|g| {
                    g.volumes
                        .values()
                        .any(|r| r.volume_type == "host" && *r.source == *volume.name)
                })
        })
        .map(|a| format!("allocation {} of job {}", a.id, a.job_id))
        .collect())
}

/// Who asks, as this machine names them (informational: the signature authenticates).
fn requested_by() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    format!("{user}@{host}")
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `volume unpublish`: refused without `-force` while an allocation on the node runs with
/// the volume; else the signed request, then (unless `-detach`) the wait for the node's
/// answer: exit 0 when it unpublished the volume (or found it not mounted), 1 when it
/// refused, 75 when it did not answer in time.
pub async fn unpublish(
    client: &Client,
    ns: &str,
    args: UnpublishArgs,
    key: SigningArgs,
) -> Result<(), Failure> {
    let r = read_record(client, ns, &args.name).await?;
    let volume = r.key();
    let (records, _) = nodes::list(client).await?;
    let (node_id, node_name) = resolve_node(&records, &args.node)?;
    let running = running_on(client, &node_id, &volume).await?;
    if !running.is_empty() && !args.force {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "volume {volume} is in use on node {node_name} ({node_id}) by {}: stop them first, or give -force to take it from them (their tasks lose the volume and do not get it back while they run)",
                running.join(", ")
            ),
        ));
    }
    let key = key.load()?;
    let path = request_path(&volume.name);
    let existing = client.variable(&volume.namespace, &path).await?;
    if let Some(var) = &existing {
        if let Ok(old) = UnpublishRequest::from_variable(var) {
            if old.actionable(now_ms()) {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "an unpublish request for volume {volume} on node {} by {} is still pending: wait for it (or until it is 10 minutes old)",
                        old.node_id,
                        old.who()
                    ),
                ));
            }
        }
    }
    let mut req = UnpublishRequest::new(
        volume.clone(),
        node_id.clone(),
        args.kill,
        uuid::Uuid::new_v4().to_string(),
        now_ms(),
        requested_by(),
    );
    match &key {
        Some(k) => req.sign(k),
        None => eprintln!("warning: the request is not signed (no -signing-key): nodes with --record-keys ignore it, only one with --allow-unsigned-records acts on it"),
    }
    for line in &running {
        eprintln!(
            "warning: {line} on node {node_name} runs with the volume: its tasks lose it (-force)"
        );
    }
    tracing::warn!(%volume, node = %node_id, kill = args.kill, requested_by = %req.who(), "operator forces an unpublish (`volume unpublish -force`)");
    let cas = existing.as_ref().map_or(0, |v| v.modify_index);
    match crate::cluster::changes::put_record(client, &req.to_variable(), Some(cas)).await {
        Ok(_) => {}
        Err(NomadError::CasConflict { .. }) => {
            return Err(Failure::new(
                EXIT_FAILED,
                format!("another unpublish request for volume {volume} was written meanwhile; run the command again"),
            ))
        }
        Err(e) => return Err(e.into()),
    }
    outln!(
        "==> Unpublish of volume {volume} on node {node_name} ({node_id}) requested{}",
        if args.kill {
            ", killing the processes that hold it"
        } else {
            ""
        }
    );
    let Some(wait) = args.wait else {
        return Ok(());
    };
    let deadline = Instant::now() + wait;
    loop {
        let answer = client
            .variable(&volume.namespace, &path)
            .await?
            .and_then(|v| UnpublishRequest::from_variable(&v).ok())
            .filter(|a| a.id == req.id);
        match answer.as_ref().map(|a| a.state) {
            Some(RequestState::Done) => {
                let a = answer.unwrap_or(req);
                outln!(
                    "==> Node {node_name}: {}",
                    crate::escape::escape_control(&a.message)
                );
                return Ok(());
            }
            Some(RequestState::Refused) => {
                let a = answer.unwrap_or(req);
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "node {node_name} refused: {}",
                        crate::escape::escape_control(&a.message)
                    ),
                ));
            }
            Some(RequestState::Pending) | None if Instant::now() > deadline => {
                return Err(Failure::new(
                    EXIT_TIMEOUT,
                    format!(
                        "node {node_name} has not answered the unpublish request after {}: its agent may be down, or may not trust the request's signature (its log says; nodes act only on requests signed with a key in their --record-keys); the request stays pending for 10 minutes",
                        humantime::format_duration(wait)
                    ),
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, name: &str) -> nodes::NodeRecord {
        nodes::NodeRecord::new(id, name, "default")
    }

    #[test]
    fn a_node_is_named_by_name_or_unique_id_prefix() {
        let list = [rec("aaaa-1", "node-1"), rec("aabb-2", "node-2")];
        assert_eq!(resolve_node(&list, "node-2").unwrap().0, "aabb-2");
        assert_eq!(resolve_node(&list, "aaa").unwrap().0, "aaaa-1");
        let e = resolve_node(&list, "aa").unwrap_err();
        assert!(e.message.contains("matches 2 nodes"), "{}", e.message);
        assert!(resolve_node(&list, "zz").is_err());
    }
}
