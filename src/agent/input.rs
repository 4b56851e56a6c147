//! What the core is told: every message the shell receives, and every completion of an
//! effect it performed, as one typed [`Input`]. Completions carry the modules' typed errors.

pub(crate) use crate::agent::executor::Completion;
use crate::api::PublishRequest;
use crate::cluster::catalog::Catalogue;
use crate::node::journal::JournalError;
use crate::node::mounts::MountTable;
use crate::nomad::watch::WatchEvent;

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
    /// Why the volume records cannot be read now (the last list's or read's error, e.g.
    /// Nomad's 403), or `None` once they are read again.
    RecordsUnreadable(Option<String>),
    /// A fresh copy of the cluster's snapshot records.
    Snapshots(crate::cluster::snapshot::Snapshots),
    /// The operator's forced-unpublish requests that name this node, are pending and fresh
    /// and verify ([`crate::cluster::unpublish_request`]).
    UnpublishRequests(Vec<crate::cluster::unpublish_request::UnpublishRequest>),
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
    /// A Nomad Variable that published volumes reference changed (its `ModifyIndex` moved;
    /// [`crate::agent::secret_watch`]): (namespace, path).
    SecretChanged(crate::agent::refresh::Watched),
    /// Time passed (the shell's periodic tick, or a wake-up the core asked for).
    Tick,
}
