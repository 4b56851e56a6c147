//! Plugin discovery: notices plugin files added, changed or removed in the plugin directory
//! (inotify through the `notify` crate) and tells the agent to fingerprint again.
//!
//! A burst of file events (an editor's write, `cp`, `chmod`, `rm`) becomes one message after
//! a short quiet period. The agent's periodic rescan stays as the fallback for events that
//! inotify cannot see (a directory that does not exist yet, network filesystems, a full
//! inotify queue): discovery only makes changes visible sooner.

use notify::{RecursiveMode, Watcher};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

/// How long the directory must be quiet before a change is reported.
pub const SETTLE: Duration = Duration::from_millis(300);
/// How often watching is tried again while the directory cannot be watched.
const RETRY: Duration = Duration::from_secs(15);

/// Why the plugin directory cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot watch the plugin directory {dir}: {source}")]
    Watch {
        dir: PathBuf,
        #[source]
        source: notify::Error,
    },
}

/// Watches `dir` until `changed` is closed, sending `()` after each settled burst of
/// changes. `changed` should have capacity 1: a change already pending covers the next.
pub async fn run(dir: PathBuf, changed: mpsc::Sender<()>) {
    loop {
        match watch(&dir, &changed).await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(error = %e, "plugin changes are noticed by the periodic rescan only; trying again later");
                tokio::select! {
                    _ = tokio::time::sleep(RETRY) => {}
                    _ = changed.closed() => return,
                }
                // The directory may have appeared meanwhile: look at it once more.
                let _ = changed.try_send(());
            }
        }
    }
}

/// One watch of `dir`; returns `Ok` when the receiver went away.
async fn watch(dir: &Path, changed: &mpsc::Sender<()>) -> Result<(), DiscoveryError> {
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::recommended_watcher(move |ev| {
        let _ = raw_tx.send(ev);
    })
    .map_err(|source| DiscoveryError::Watch {
        dir: dir.to_path_buf(),
        source,
    })?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .map_err(|source| DiscoveryError::Watch {
            dir: dir.to_path_buf(),
            source,
        })?;
    tracing::debug!(dir = %dir.display(), "watching the plugin directory");
    loop {
        let first = tokio::select! {
            ev = raw_rx.recv() => ev,
            _ = changed.closed() => return Ok(()),
        };
        let Some(first) = first else {
            return Ok(());
        };
        if let Err(e) = first {
            tracing::warn!(error = %e, "plugin directory watch error; rescanning");
        }
        // Let the burst settle: every further event restarts the quiet period.
        while let Ok(Some(_)) = tokio::time::timeout(SETTLE, raw_rx.recv()).await {}
        if !dir.is_dir() {
            // The directory itself was removed or replaced: the watch is gone with it.
            let _ = changed.try_send(());
            return Err(DiscoveryError::Watch {
                dir: dir.to_path_buf(),
                source: notify::Error::path_not_found(),
            });
        }
        tracing::debug!("plugin directory changed; fingerprinting again");
        let _ = changed.try_send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reports_added_changed_and_removed_files_once_per_burst() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::channel(1);
        let task = tokio::spawn(run(dir.path().to_path_buf(), tx));
        // Give the watcher a moment to be in place.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let p = dir.path().join("plug");
        for step in ["add", "change", "remove"] {
            match step {
                "add" => std::fs::write(&p, "#!/bin/sh\n").unwrap(),
                "change" => std::fs::write(&p, "#!/bin/sh\necho\n").unwrap(),
                _ => std::fs::remove_file(&p).unwrap(),
            }
            tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("no change reported after {step}"))
                .unwrap();
        }
        // Nothing more without further changes.
        assert!(
            tokio::time::timeout(SETTLE * 3, rx.recv()).await.is_err(),
            "a change reported without a file event"
        );
        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }
}
