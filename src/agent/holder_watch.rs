//! The shell's watches on the processes that held a volume when its unpublish was refused
//! ([`crate::agent::effect::Effect::WatchHolders`]): one per volume (a new refusal replaces
//! the watch of the last), each a task that waits for its processes' exits
//! ([`crate::node::holders::exits::all_exited`]) and reports
//! [`Completion::HoldersExited`]. Kept out of the shell's effect tasks: a watch may wait as
//! long as a process runs, and is ended when replaced or when the shell stops.

use crate::agent::executor::Completion;
use crate::volume::VolumeKey;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// The least time from a refusal to the retry its holders' exits bring: a task that starts
/// and ends holders at a high rate makes the agent scan `/proc` at most this often.
pub(crate) const EXIT_RETRY_MIN: Duration = Duration::from_millis(200);

/// The running watches, by volume, and where they report.
#[derive(Debug)]
pub(crate) struct HolderWatches {
    running: HashMap<VolumeKey, tokio::task::AbortHandle>,
    tx: mpsc::UnboundedSender<Completion>,
    rx: mpsc::UnboundedReceiver<Completion>,
}

impl Default for HolderWatches {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            running: HashMap::new(),
            tx,
            rx,
        }
    }
}

impl HolderWatches {
    /// Watches `pids` for `volume`, ending its earlier watch. Call within the runtime.
    pub(crate) fn watch(&mut self, volume: VolumeKey, pids: Vec<u32>) {
        let tx = self.tx.clone();
        let v = volume.clone();
        let task = tokio::spawn(async move {
            tokio::join!(
                crate::node::holders::exits::all_exited(&pids),
                tokio::time::sleep(EXIT_RETRY_MIN)
            );
            let _ = tx.send(Completion::HoldersExited { volume: v });
        });
        if let Some(old) = self.running.insert(volume, task.abort_handle()) {
            old.abort();
        }
        self.running.retain(|_, t| !t.is_finished());
    }

    /// The next report of a watch that saw its processes exit.
    pub(crate) async fn next(&mut self) -> Option<Completion> {
        let done = self.rx.recv().await;
        if let Some(Completion::HoldersExited { volume }) = &done {
            self.running.remove(volume);
        }
        done
    }
}

impl Drop for HolderWatches {
    fn drop(&mut self) {
        self.running
            .values()
            .for_each(tokio::task::AbortHandle::abort);
    }
}
