//! What the core is told: every message the shell receives, and every completion of an
//! effect it performed, as one typed [`Input`]. Completions carry the modules' typed errors.

use crate::api::PublishRequest;
use crate::catalog::Catalogue;
use crate::claims::ClaimError;
use crate::executor::{PlaceholderError, StepError, WorkerError};
use crate::health::Probe;
use crate::journal::JournalError;
use crate::mounts::MountTable;
use crate::nomad::types::Allocation;
use crate::nomad::NomadError;
use crate::plugin::{Fingerprint, PluginError};
use crate::volume::VolumeKey;
use crate::watch::WatchEvent;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Names one caller waiting for an answer; the shell keeps the reply channel, so the core
/// stays plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ReplyId(pub u64);

/// A call on the local API.
#[derive(Debug)]
pub(crate) enum ApiCall {
    /// A prestart task waits until its allocation's volumes are published.
    Publish(PublishRequest),
    /// `dhv-binder status`.
    Status,
}

/// One message for the core.
#[derive(Debug)]
pub(crate) enum Input {
    /// From the allocation watcher.
    Watch(WatchEvent),
    /// A fresh copy of the cluster's volume records.
    Catalogue(Catalogue),
    /// A caller on the local API; answer with [`crate::agent::effect::Effect::Reply`].
    Api { reply: ReplyId, call: ApiCall },
    /// The caller went away (its connection closed) before it was answered.
    CallerGone(ReplyId),
    /// The plugin directory changed: fingerprint again now.
    PluginsChanged,
    /// The mount table as read now.
    MountTable(MountTable),
    /// A journal commit is durable (or failed).
    Committed {
        seq: u64,
        result: Result<(), JournalError>,
    },
    /// An effect finished.
    Done(Completion),
    /// Time passed (the shell's periodic tick, or a wake-up the core asked for).
    Tick,
}

/// The outcome of one effect.
#[derive(Debug)]
pub(crate) enum Completion {
    /// `publish` ran; `Ok` carries the plugin's `context`.
    Published {
        volume: VolumeKey,
        result: Result<serde_json::Value, StepError>,
        elapsed: Duration,
    },
    /// `unpublish` ran (and the empty target directory was removed).
    Unpublished {
        volume: VolumeKey,
        result: Result<(), StepError>,
    },
    /// Every plugin in the directory, fingerprinted.
    Plugins(BTreeMap<String, Result<Fingerprint, PluginError>>),
    /// This node's placeholder host volumes (volume → host volume ID).
    PlaceholdersListed(Result<BTreeMap<VolumeKey, String>, NomadError>),
    /// A placeholder was registered (`Some(id)`) or deregistered (`None`).
    Placeholder {
        volume: VolumeKey,
        result: Result<Option<String>, PlaceholderError>,
    },
    /// A volume create or delete ran.
    Worker {
        volume: VolumeKey,
        result: Result<(), WorkerError>,
    },
    /// A claim acquire: the lock ID.
    ClaimAcquired {
        volume: VolumeKey,
        result: Result<String, ClaimError>,
    },
    ClaimRenewed {
        volume: VolumeKey,
        result: Result<(), ClaimError>,
    },
    ClaimReleased {
        volume: VolumeKey,
        result: Result<(), ClaimError>,
    },
    /// One allocation read from Nomad (`None`: it does not exist).
    AllocFetched {
        alloc_id: String,
        result: Result<Option<Box<Allocation>>, NomadError>,
    },
    /// A published mount was probed.
    Probed {
        volume: VolumeKey,
        target: PathBuf,
        probe: Probe,
    },
    /// A dead mount was detached (lazy unmount).
    Detached {
        volume: VolumeKey,
        result: Result<(), nix::Error>,
    },
    /// An allocation was restarted onto a republished mount.
    Restarted {
        volume: VolumeKey,
        alloc_id: String,
        result: Result<(), NomadError>,
    },
}
