//! `volume delete` and `volume deregister`: refused while the volume is in use or mounted
//! anywhere (on evidence), then the record's delete request and the wait for it.

use super::super::records::{read_var, users_of};
use super::super::{Failure, EXIT_FAILED, EXIT_TIMEOUT};
use super::eligibility::why_waiting;
use crate::cluster::trust::SigningKey;
use crate::cluster::{mounted, nodes};
use crate::escape::escape_control;
use crate::nomad::{Client, NomadError};
use crate::volume::{self, VolumeRecord, VolumeState};
use std::time::{Duration, Instant};
/// Refused while an allocation uses the volume, then [`refuse_mounted`].
async fn refuse_in_use(client: &Client, r: &VolumeRecord) -> Result<(), Failure> {
    let users = users_of(client, &r.spec.namespace, &r.spec.name).await?;
    if users.is_empty() {
        return refuse_mounted(client, r).await;
    }
    let list: Vec<String> = users
        .iter()
        .map(|u| format!("{} ({}, node {})", u.alloc_id, u.alloc_name, u.node_id))
        .collect();
    Err(Failure::new(
        EXIT_FAILED,
        format!(
            "volume {} is in use by allocations: {}; stop them first",
            r.key(),
            list.join(", ")
        ),
    ))
}

/// Delete and deregister on evidence: refused while a node's record shows the volume
/// mounted, publishing or unpublishing, a stale record lists it, or a node holds its claim
/// (`cluster::mounted`). A node's record follows its mounts within a moment, so a volume
/// whose last unpublish has just finished is given up to 5 s to clear.
async fn refuse_mounted(client: &Client, r: &VolumeRecord) -> Result<(), Failure> {
    let key = r.key();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let on = mounted::evidence(client, &key, super::super::output::now_unix()).await?;
        if on.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Failure::new(EXIT_FAILED, mounted::refusal(&key, &on)));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `volume delete`: the delete request in the record (the plugin's `delete` runs on a
/// node), then the wait for the record to go unless `wait` is `None`.
pub async fn delete(
    client: &Client,
    ns: &str,
    name: String,
    wait: Option<Duration>,
    key: Option<SigningKey>,
) -> Result<(), Failure> {
    let (mut r, registered) = read_var(client, ns, &name).await?;
    // An ID prefix names the volume too: from here on, its name.
    let name = r.spec.name.clone();
    if registered {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "volume {} was registered: dhv-binder did not create its storage and will not delete it; use `dhv-binder volume deregister {name}`",
                r.key()
            ),
        ));
    }
    refuse_in_use(client, &r).await?;
    if matches!(r.state, VolumeState::Failed | VolumeState::Pending) {
        crate::cluster::changes::delete_record(
            client,
            &r.spec.namespace,
            &volume::record_path(&name),
            Some(r.modify_index),
        )
        .await?;
        outln!(
            "==> Deleted volume record {} (no storage had been created)",
            r.key()
        );
        return Ok(());
    }
    r.state = VolumeState::Deleting;
    r.worker_node.clear();
    if let Some(k) = &key {
        k.sign_delete(&mut r);
    }
    crate::cluster::changes::put_record(client, &r.to_variable(), Some(r.modify_index)).await?;
    outln!("==> Delete of {} requested", r.key());
    let Some(wait) = wait else {
        return Ok(());
    };
    let deadline = Instant::now() + wait;
    loop {
        match client
            .variable(&r.spec.namespace, &volume::record_path(&name))
            .await?
        {
            None => {
                outln!("==> Volume {} deleted", r.key());
                return Ok(());
            }
            Some(var) if Instant::now() > deadline => {
                let cur = VolumeRecord::from_variable(&var)
                    .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
                let records = nodes::list(client).await?.0;
                let why = if cur.error.is_empty() {
                    why_waiting(&cur, &records, super::super::output::now_unix())
                } else {
                    Some(format!("the last attempt failed: {}", escape_control(&super::super::output::plugin_text(&cur.error))))
                }
                .unwrap_or_else(|| {
                    format!(
                        "no agent has reported why: see `dhv-binder plugin status {}` and the agents' logs",
                        cur.spec.plugin_id
                    )
                });
                return Err(Failure::new(
                    EXIT_TIMEOUT,
                    format!(
                        "the delete of volume {} is still pending after {}: {why} (the request stays; `dhv-binder volume status {name}` shows it)",
                        cur.key(),
                        humantime::format_duration(wait)
                    ),
                ));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}
/// `volume deregister`: the record removed, the storage left as it is.
pub async fn deregister(client: &Client, ns: &str, name: String) -> Result<(), Failure> {
    let (r, registered) = read_var(client, ns, &name).await?;
    // An ID prefix names the volume too: from here on, its name.
    let name = r.spec.name.clone();
    if matches!(r.state, VolumeState::Creating | VolumeState::Deleting) {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "volume {} is {}: a node is running the plugin on it; wait until it is done",
                r.key(),
                r.state.as_str()
            ),
        ));
    }
    refuse_in_use(client, &r).await?;
    match crate::cluster::changes::delete_record(
        client,
        &r.spec.namespace,
        &volume::record_path(&name),
        Some(r.modify_index),
    )
    .await
    {
        Ok(()) => {}
        Err(NomadError::CasConflict { .. }) => {
            return Err(Failure::new(
                EXIT_FAILED,
                format!("volume {} changed meanwhile; try again", r.key()),
            ))
        }
        Err(e) => return Err(e.into()),
    }
    outln!(
        "==> Deregistered volume {}{}; the storage was left as it is",
        r.key(),
        if registered {
            ""
        } else {
            " (it had been created by the plugin)"
        }
    );
    Ok(())
}
