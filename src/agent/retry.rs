//! What the agent retries, and how fast: one [`Retries`] table keyed by [`Work`] for every
//! kind of work, feeding the core's `next_wakeup`.

use crate::nomad::retry::Policy;
use crate::volume::VolumeKey;
use std::time::Duration;

pub(crate) use crate::nomad::retry::Retries;

/// One retried piece of work.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Work {
    /// A publish or unpublish of the volume on this node.
    Mount(VolumeKey),
    /// Registering or deregistering the volume's placeholder host volume.
    Placeholder(VolumeKey),
    /// Listing this node's placeholder host volumes (agent/placeholders.rs).
    PlaceholderList,
    /// Creating or deleting the volume.
    Worker(VolumeKey),
    /// Taking the volume's single-node claim.
    Claim(VolumeKey),
    /// A snapshot or expansion step (agent/storage_ops.rs).
    Storage(crate::cluster::worker::OpKey),
    /// Writing a "final" publish failure into the volume's record (agent/offer.rs).
    FinalMark(VolumeKey),
}

/// Plugin calls, placeholders (their listing too), create/delete: 1 s doubling to 60 s.
pub(crate) const STEP_RETRY: Policy = Policy {
    base: Duration::from_secs(1),
    cap: Duration::from_secs(60),
};

/// Claims: 0.5 s doubling to 3 s (the holder may let go any moment).
pub(crate) const CLAIM_RETRY: Policy = Policy {
    base: Duration::from_millis(500),
    cap: Duration::from_secs(3),
};
