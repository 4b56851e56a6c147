//! What the core asks the shell to do. The shell performs each [`Effect`] and reports its
//! outcome as an [`crate::agent::input::Completion`]; the core itself never performs I/O.

use crate::agent::input::ReplyId;
use crate::api::{ApiError, PublishReply};
use crate::node::journal::{Commit, MountRecord};
use crate::volume::{VolumeKey, VolumeRecord};
use std::path::PathBuf;

/// One piece of work for the shell.
#[derive(Debug)]
pub(crate) enum Effect {
    /// Plugin `publish` of `volume` onto `target` (creating the directory first).
    Publish {
        volume: Box<VolumeRecord>,
        target: PathBuf,
        read_only: bool,
        alloc_id: String,
        /// What the last publish established at the target: anything else found there
        /// is not published over.
        expected: Option<crate::node::mounts::MountIdentity>,
    },
    /// Plugin `unpublish` of a journal record; `keep_dir` re-creates the empty target
    /// directory afterwards (a placeholder host volume still points at it).
    Unpublish {
        mount: Box<MountRecord>,
        volume: Option<Box<VolumeRecord>>,
        keep_dir: bool,
    },
    /// Fingerprint the plugins in the plugin directory: every one when `changed_only` is
    /// false (at start, and when the directory watch saw a change), else (the periodic
    /// rescan) only those whose file changed since their last good fingerprint, the rest
    /// keeping it without an exec ([`crate::storage::plugin::Runner::fingerprint_if_changed`]).
    Fingerprint { changed_only: bool },
    /// Nomad: read this node's attributes and meta (what volume constraints are evaluated
    /// against).
    ReadNode,
    /// Plugin `create` (with the record's check-and-set claim).
    Create(Box<VolumeRecord>),
    /// Plugin `delete` (with the record's check-and-set claim).
    Delete(Box<VolumeRecord>),
    /// A snapshot or expansion step (agent/storage_ops.rs decides, taken by check-and-set).
    Storage(crate::agent::executor::storage::StorageOp),
    /// Nomad: write a "final" publish failure into the record of `volume` (still the volume
    /// `volume_id`), so that every node stops offering it.
    MarkFinal {
        volume: VolumeKey,
        volume_id: String,
        failure: crate::volume::final_failure::FinalFailure,
    },
    /// Nomad: list this node's placeholder host volumes, reading only those of
    /// `namespaces` (the namespaces this node serves volumes or knows placeholders in).
    ListPlaceholders {
        namespaces: std::collections::BTreeSet<String>,
    },
    /// Nomad: register the placeholder host volume of `volume` at `target`; `id` set
    /// registers an existing (unavailable) one again.
    RegisterPlaceholder {
        volume: Box<VolumeRecord>,
        target: PathBuf,
        id: Option<String>,
    },
    /// Nomad: deregister a placeholder host volume.
    DeregisterPlaceholder { volume: VolumeKey, id: String },
    /// Nomad: take the single-node claim. With `fencing` (the volume's record; its plugin
    /// declares `fence_node`), a take-over fences the old holder at the storage (and unfences
    /// this node when it was fenced) before the claim counts as taken.
    AcquireClaim {
        volume: VolumeKey,
        volume_id: String,
        fencing: Option<Box<VolumeRecord>>,
    },
    /// The renewal thread ([`crate::agent::renewer`]): renew the claim's lock (acquired at
    /// the claim's ModifyIndex `acquired_index`) every TTL/3 from now on, the first time at
    /// once with `at_once` (a claim restored after a restart), until [`Effect::StopRenewing`].
    RenewClaim {
        volume: VolumeKey,
        lock_id: String,
        acquired_index: Option<u64>,
        at_once: bool,
    },
    /// The renewal thread: stop renewing the volume's claim (released, lost or forgotten).
    StopRenewing { volume: VolumeKey },
    /// Nomad: give the claim back.
    ReleaseClaim { volume: VolumeKey, lock_id: String },
    /// Nomad: read one allocation (a publish call came before its event).
    FetchAlloc { alloc_id: String },
    /// Nomad: restart an allocation's running tasks (onto a republished mount), or only
    /// `task` (an ungated task, onto its volume's first publish), or with `all_tasks` every
    /// task, those that exited included (an ungated task that exited on the placeholder
    /// while its allocation runs on).
    RestartAlloc {
        volume: VolumeKey,
        alloc_id: String,
        task: Option<String>,
        all_tasks: bool,
    },
    /// Kernel: `stat` a published target, bounded by the probe timeout.
    Probe { volume: VolumeKey, target: PathBuf },
    /// Kernel: make the volume at `target` unwritable on this node now, without the network
    /// ([`crate::node::fence::fence`]: every process holding it but the agent is killed).
    /// With `plugin` (its fingerprint declares `fence`), the plugin's `fence` runs beside
    /// it, bounded by [`crate::storage::plugin::FENCE_TIMEOUT`].
    ///
    /// `lease_of`: the lock ID of the claim whose lease is ending (`None` for a fence that
    /// no renewal undoes: an operator's release). Right before the fence runs, the shell
    /// checks the renewal thread's evidence ([`crate::agent::renewer::Evidence`]): when a
    /// renewal of that lock succeeded that keeps the lease beyond the fence moment, nothing
    /// is killed and the fence is withdrawn ([`Completion::FenceWithdrawn`]).
    ///
    /// [`Completion::FenceWithdrawn`]: crate::agent::executor::Completion::FenceWithdrawn
    Fence {
        volume: VolumeKey,
        target: PathBuf,
        plugin: Option<Box<PluginFence>>,
        lease_of: Option<String>,
    },
    /// Kernel: wait for the processes `pids` that held `volume` when its unpublish was
    /// refused to exit (pidfds, [`crate::node::holders::exits`]); answered by
    /// [`Completion::HoldersExited`] once all have. Replaces the volume's earlier watch.
    ///
    /// [`Completion::HoldersExited`]: crate::agent::executor::Completion::HoldersExited
    WatchHolders { volume: VolumeKey, pids: Vec<u32> },
    /// Kernel: kill the processes holding the volume mounted at `target` for an operator's
    /// forced unpublish, as the fence kills them ([`crate::node::fence::kill_holders`]: by cgroup
    /// identity, never the agent; the host's mount is made read-only too). Answered by
    /// [`Completion::HoldersKilled`].
    ///
    /// [`Completion::HoldersKilled`]: crate::agent::executor::Completion::HoldersKilled
    KillHolders { volume: VolumeKey, target: PathBuf },
    /// Nomad: write this node's answer into an operator's forced-unpublish request
    /// ([`crate::cluster::unpublish_request::answer`]); a failure is logged.
    AnswerUnpublish {
        request: Box<crate::cluster::unpublish_request::UnpublishRequest>,
        state: crate::cluster::unpublish_request::RequestState,
        message: String,
    },
    /// Kernel: lazily unmount a dead mount.
    Detach { volume: VolumeKey, target: PathBuf },
    /// Plugin `refresh` of a published volume (its plugin declares `refresh`): the
    /// volume's current secrets applied to its mount without an unmount
    /// ([`crate::agent::refresh`]); answered by [`Completion::Refreshed`].
    ///
    /// [`Completion::Refreshed`]: crate::agent::executor::Completion::Refreshed
    Refresh {
        volume: Box<VolumeRecord>,
        mount: Box<MountRecord>,
    },
    /// Kernel: read the mount table again (answered by `Input::MountTable`); the tick's
    /// check, so an unchanged table may be up to 10 s old
    /// ([`crate::node::mounts::MountTable::read_idle`]).
    ReadMountTable,
    /// Journal: make `commit` durable off the loop, then perform `then` (the plugin calls
    /// and answers that must not start before their intents are on disk).
    Commit { commit: Commit, then: Vec<Effect> },
    /// Answer a caller.
    Reply { to: ReplyId, answer: Answer },
}

/// An answer to a caller of the local API.
#[derive(Debug)]
pub(crate) enum Answer {
    Publish(Result<PublishReply, ApiError>),
    Status(Box<serde_json::Value>),
}

/// The publishes `effects` start (at once, or once their commit is durable).
#[cfg(test)]
pub(crate) fn publishes(effects: &[Effect]) -> usize {
    effects
        .iter()
        .map(|e| match e {
            Effect::Publish { .. } => 1,
            Effect::Commit { then, .. } => publishes(then),
            _ => 0,
        })
        .sum()
}

/// What a plugin's `fence` call needs: the mount and, when known, the volume's record (its
/// context and secrets).
#[derive(Debug, Clone)]
pub(crate) struct PluginFence {
    pub mount: MountRecord,
    pub record: Option<VolumeRecord>,
}
