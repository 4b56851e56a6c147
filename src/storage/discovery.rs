//! Plugin discovery: notices plugin files added, changed or removed in the plugin directory
//! (inotify through the `notify` crate) and tells the agent to fingerprint again.
//!
//! Only events that alter what the directory holds count ([`alters_contents`]): create,
//! delete, move, close-after-write, attribute changes. Opening or reading a file does not:
//! running a plugin opens its file, and reacting to that would fingerprint again after every
//! plugin call, forever. A burst of file events (an editor's write, `cp`, `chmod`, `rm`)
//! becomes one message after a short quiet period. The agent's periodic rescan stays as the fallback for events that
//! inotify cannot see (a directory that does not exist yet, network filesystems, a full
//! inotify queue): discovery only makes changes visible sooner.

use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
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

/// True when an inotify event (as the `notify` crate reports it) can alter the directory's
/// contents: a file created, deleted or moved, written and closed, or its attributes changed
/// (`chmod` makes a file a plugin or not), the directory itself removed or moved, or a queue
/// overflow (events were lost: look again). False for opening, reading and closing without
/// writing, and for a write still in progress (its close-after-write follows).
pub fn alters_contents(ev: &notify::Event) -> bool {
    if ev.need_rescan() {
        return true;
    }
    match ev.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        EventKind::Modify(ModifyKind::Data(_)) => false,
        EventKind::Modify(_) | EventKind::Create(_) | EventKind::Remove(_) => true,
        // Unknown kinds: fail closed, look again.
        EventKind::Any | EventKind::Other => true,
    }
}

/// Starts watching `dir`, passing on watch errors and the events that [`alters_contents`].
fn start_watch(
    dir: &Path,
) -> Result<
    (
        notify::RecommendedWatcher,
        mpsc::UnboundedReceiver<notify::Result<notify::Event>>,
    ),
    DiscoveryError,
> {
    let (raw_tx, raw_rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.as_ref().map_or(true, alters_contents) {
            let _ = raw_tx.send(ev);
        }
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
    Ok((watcher, raw_rx))
}

/// One watch of `dir`; returns `Ok` when the receiver went away.
async fn watch(dir: &Path, changed: &mpsc::Sender<()>) -> Result<(), DiscoveryError> {
    let (_watcher, mut raw_rx) = start_watch(dir)?;
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
        let outside = tempfile::tempdir().unwrap();
        for step in ["add", "change", "chmod", "move out", "move in", "remove"] {
            match step {
                "add" => std::fs::write(&p, "#!/bin/sh\n").unwrap(),
                "change" => std::fs::write(&p, "#!/bin/sh\necho\n").unwrap(),
                "chmod" => {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap()
                }
                "move out" => std::fs::rename(&p, outside.path().join("plug")).unwrap(),
                "move in" => std::fs::rename(outside.path().join("plug"), &p).unwrap(),
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

    /// Running a plugin (exec opens its file) and reading files are not changes: none of
    /// the events they cause passes the filter, and a real change after them still does.
    /// Counted, not timed: inotify keeps the order of events, so every event passed on
    /// before the marker's would come from the runs.
    #[tokio::test]
    async fn running_plugins_causes_no_event_and_a_real_change_still_does() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = dir.path().join("fake");
        std::fs::write(
            &plugin,
            "#!/bin/sh\necho '{\"version\":\"1.0.0\",\"deferred_bind\":true}'\n",
        )
        .unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let (_watcher, mut rx) = start_watch(dir.path()).unwrap();
        let runner = crate::storage::plugin::Runner::new(dir.path(), Duration::from_secs(10));
        for _ in 0..20 {
            runner.fingerprint("fake").await.unwrap();
            std::fs::read(&plugin).unwrap();
            assert!(runner.list().unwrap().contains(&"fake".to_string()));
        }
        let marker = dir.path().join("marker");
        std::fs::write(&marker, "").unwrap();
        let mut before_marker = Vec::new();
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("the real change was not reported")
                .unwrap()
                .unwrap();
            if ev.paths.contains(&marker) {
                break;
            }
            before_marker.push(ev);
        }
        assert_eq!(
            before_marker.len(),
            0,
            "plugin runs were reported as changes, e.g. {:?}",
            before_marker.first()
        );
    }

    #[test]
    fn only_content_changes_pass_the_filter() {
        use notify::event::{CreateKind, DataChange, Flag, MetadataKind, RemoveKind, RenameMode};
        let ev = |k| notify::Event::new(k);
        for k in [
            EventKind::Create(CreateKind::File),
            EventKind::Remove(RemoveKind::File),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Modify(ModifyKind::Name(RenameMode::From)),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)),
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Other,
        ] {
            assert!(alters_contents(&ev(k)), "{k:?}");
        }
        for k in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Open(AccessMode::Execute)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
        ] {
            assert!(!alters_contents(&ev(k)), "{k:?}");
        }
        let overflow = ev(EventKind::Access(AccessKind::Read)).set_flag(Flag::Rescan);
        assert!(alters_contents(&overflow));
    }
}
