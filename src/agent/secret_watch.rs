//! Follows the Nomad Variables that this node's published volumes reference, so that a
//! changed value reaches their mounts at once (the plugin's `refresh`,
//! [`crate::agent::refresh`]). Runs beside the core on a task of its own: the shell hands it
//! the set to follow after each pass ([`SecretWatch::follow`], from
//! [`crate::agent::refresh::watched`]) and feeds each change it reports to the core as
//! [`crate::agent::input::Input::SecretChanged`].
//!
//! Each Variable is followed by a blocking read of that one variable (Nomad API:
//! `GET /v1/var/:path?namespace=ns&index=N&wait=5m`, answered when its `ModifyIndex` passes
//! `N`; `nomad/variables_endpoint.go` `Variables.Read`), with the agent's own token (its
//! policy grants read on `--secrets-path`). Bounded: at most [`MAX_WATCHED`] variables at once
//! (the others are refreshed on their plugin's period only, said once in the log), one read
//! out per variable, the next one at least [`MIN_INTERVAL`] after an answer; a failed read
//! is tried again after a backoff (0.5 s doubling up to 60 s), a missing variable read
//! again every [`MISSING_RECHECK`] (a blocking read of a missing variable would wake on
//! every variable write). The first read of a variable only learns its index: a change
//! between a publish's read and that first read is applied by the plugin's period.

use crate::agent::refresh::Watched;
use crate::nomad::Client;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The most Variables followed at once.
pub(crate) const MAX_WATCHED: usize = 256;

/// How long one blocking read waits for a change.
const WAIT: Duration = Duration::from_secs(300);

/// The shortest time between two reads of one variable (a burst of writes is one change).
pub(crate) const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// How often a missing variable is read again.
pub(crate) const MISSING_RECHECK: Duration = Duration::from_secs(30);

/// The shell's side of the watch task.
pub(crate) struct SecretWatch {
    tx: tokio::sync::watch::Sender<BTreeSet<Watched>>,
    task: tokio::task::JoinHandle<()>,
}

impl SecretWatch {
    /// Starts following, with `client`'s token; each change is sent on `changed`.
    pub(crate) fn start(client: Client, changed: tokio::sync::mpsc::Sender<Watched>) -> Self {
        let (tx, rx) = tokio::sync::watch::channel(BTreeSet::new());
        let task = tokio::spawn(supervise(client, rx, changed));
        Self { tx, task }
    }

    /// Follows exactly `set` from now on (reads of variables no longer in it are dropped).
    pub(crate) fn follow(&self, set: BTreeSet<Watched>) {
        self.tx.send_if_modified(|s| {
            let changed = *s != set;
            *s = set;
            changed
        });
    }
}

impl Drop for SecretWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn supervise(
    client: Client,
    mut rx: tokio::sync::watch::Receiver<BTreeSet<Watched>>,
    changed: tokio::sync::mpsc::Sender<Watched>,
) {
    // Dropped with this task (the agent stopping): every read is aborted with it.
    let mut reads = tokio::task::JoinSet::new();
    let mut running: BTreeMap<Watched, tokio::task::AbortHandle> = BTreeMap::new();
    let mut told_cap = false;
    loop {
        let want = rx.borrow_and_update().clone();
        running.retain(|w, h| {
            let keep = want.contains(w);
            if !keep {
                h.abort();
            }
            keep
        });
        for w in &want {
            if running.contains_key(w) {
                continue;
            }
            if running.len() >= MAX_WATCHED {
                if !told_cap {
                    tracing::warn!(
                        limit = MAX_WATCHED,
                        referenced = want.len(),
                        "more secret variables are referenced by published volumes than are followed: the others are refreshed on their plugin's refresh_interval only"
                    );
                    told_cap = true;
                }
                break;
            }
            let h = reads.spawn(follow_one(client.clone(), w.clone(), changed.clone()));
            running.insert(w.clone(), h);
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            Some(_) = reads.join_next() => {}
        }
    }
}

/// Follows one variable until aborted, sending `w` on `changed` at each change.
async fn follow_one(client: Client, w: Watched, changed: tokio::sync::mpsc::Sender<Watched>) {
    let (namespace, path) = (&w.0, &w.1);
    let mut index = 0u64;
    let mut missing = false;
    let mut attempt = 0u32;
    let mut logged: Option<Instant> = None;
    loop {
        let pause = match client.variable_blocking(namespace, path, index, WAIT).await {
            Ok(r) => {
                attempt = 0;
                match r.value {
                    Some(v) => {
                        // A change: a new index, or the variable written after it was missing.
                        let new = (index > 0 && v.modify_index != index) || missing;
                        if new && changed.send(w.clone()).await.is_err() {
                            return;
                        }
                        index = v.modify_index.max(1);
                        missing = false;
                        MIN_INTERVAL
                    }
                    None => {
                        index = 0;
                        missing = true;
                        MISSING_RECHECK
                    }
                }
            }
            Err(e) => {
                let now = Instant::now();
                if logged.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
                    logged = Some(now);
                    tracing::warn!(%namespace, %path, error = %e, "cannot follow a secret variable of a published volume; retrying after a backoff (logged at most once a minute): a change is applied at the plugin's refresh_interval meanwhile");
                }
                attempt = attempt.saturating_add(1);
                crate::nomad::retry::backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(60),
                    attempt,
                )
            }
        };
        tokio::time::sleep(pause).await;
    }
}
