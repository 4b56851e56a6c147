//! Install checks: what this node must hold before the agent can serve anything, and the
//! backoff the agent waits with while something is missing.
//!
//! A node added to the cluster before it was prepared gets the system job's allocation at
//! once. Exiting would make Nomad restart the task every few seconds for ever (a crash loop
//! that names the problem once per restart, among restarts). Instead the agent names every
//! missing item, one message each, and checks again after a delay that doubles up to
//! [`MAX_DELAY`]: it never spins, and starts by itself once the node is prepared.

use crate::config::AgentConfig;
use std::path::PathBuf;
use std::time::Duration;

/// The first wait after an install check failed.
pub const FIRST_DELAY: Duration = Duration::from_secs(5);
/// The longest wait between two install checks.
pub const MAX_DELAY: Duration = Duration::from_secs(300);

/// One thing the node lacks, with what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Missing {
    /// `--record-keys` names a file that does not exist.
    #[error("the record keys file {0} does not exist: put the operators' public key lines there (`dhv-binder volume keygen` prints one; root-owned; docs/security.md)")]
    RecordKeys(PathBuf),
    /// A `--plugin-root <plugin_id>=<dir>` directory does not exist.
    #[error("the storage root {dir} of plugin {plugin:?} (--plugin-root, DHV_BINDER_PLUGIN_ROOTS) does not exist: create it (install -d {dir}) on storage every node that may publish its volumes sees, or remove it from the setting")]
    PluginRoot { plugin: String, dir: PathBuf },
}

/// Every item of the node's configuration that names something absent. Only absence is
/// reported here; a file or directory that exists but is unusable is refused at start with
/// its own error.
pub fn missing(cfg: &AgentConfig) -> Vec<Missing> {
    let mut out = Vec::new();
    if let Some(keys) = &cfg.record_keys {
        if !keys.exists() {
            out.push(Missing::RecordKeys(keys.clone()));
        }
    }
    for setting in &cfg.plugin_roots {
        if let Some((plugin, dir)) = setting.split_once('=') {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() && !dir.exists() {
                out.push(Missing::PluginRoot {
                    plugin: plugin.to_string(),
                    dir,
                });
            }
        }
    }
    out
}

/// The delays between install checks: [`FIRST_DELAY`], doubling, at most [`MAX_DELAY`].
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: FIRST_DELAY }
    }
}

impl Backoff {
    /// The next delay (and doubles the one after it).
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(MAX_DELAY);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_per_missing_item_each_saying_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("exports");
        std::fs::create_dir(&present).unwrap();
        let cfg = {
            use clap::Parser;
            #[derive(Parser)]
            struct A {
                #[command(flatten)]
                a: AgentConfig,
            }
            A::parse_from([
                "x",
                "--record-keys",
                dir.path().join("record-keys.pub").to_str().unwrap(),
                "--plugin-root",
                &format!("bind={}", present.display()),
                "--plugin-root",
                &format!("ext4={}", dir.path().join("images").display()),
            ])
            .a
        };
        let m = missing(&cfg);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(m[0].to_string().contains("record-keys.pub does not exist"));
        assert!(m[0].to_string().contains("volume keygen"));
        assert!(m[1].to_string().contains("\"ext4\""));
        assert!(m[1].to_string().contains("install -d"));
    }

    #[test]
    fn the_backoff_doubles_up_to_five_minutes() {
        let mut b = Backoff::default();
        let delays: Vec<u64> = (0..9).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(delays, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
    }
}
