//! This node: what its kernel says and what it remembers.
//!
//! Nothing here talks to Nomad or runs a plugin; every answer comes from the host itself.
//! - [`mounts`]: the mount table ([`mounts::MountTable`]), read as bytes, notice of its
//!   changes ([`mounts::MountChanges`]), and the kernel's answer whether one mount is in
//!   use ([`mounts::busy`]);
//! - [`host`]: the host's mount namespace (the agent must run in it) and resolved
//!   directories;
//! - [`install`]: what the node must hold before the agent serves (record keys, storage
//!   roots), and the backoff it waits with meanwhile;
//! - [`clock`]: the agent's clock, monotonic and counting the time the machine was
//!   suspended (`CLOCK_BOOTTIME`), for the claims' lease;
//! - [`leases`]: the claims' last renewals that succeeded, kept across an agent restart on
//!   the same boot (so a restored claim's lease end is known);
//! - `guard`: the read-only guard that keeps unpublished placeholders unwritable;
//! - [`identity`]: whose process it is (a Nomad task's, a container's, another simulated
//!   node's), from its cgroup, never its environment;
//! - `holders`: the processes still using a published volume;
//! - `fence`: making a volume unwritable on this node without the network (a claim's lease
//!   about to end);
//! - [`beneath`]: paths beneath a storage root, resolved once with no symlink followed and
//!   used by handle (bind mounts, removals, directories, renames for `dhv-binder helper`);
//! - [`copy`]: a directory tree copied by handle, every entry opened relative to its
//!   directory's handle with no symlink followed (`dhv-binder helper copy`);
//! - [`helpers`]: the per-volume cgroups plugins' long-lived helpers run in, outside the
//!   daemon's own cgroup;
//! - `freeze`: thawing a filesystem a snapshot call left frozen;
//! - `health`: the mount probe (`stat` with a timeout) and the lazy detach;
//! - [`usage`]: a mounted filesystem's usage by `statfs` (a thread per call, a timeout,
//!   one call out per target) and a volume's condition;
//! - [`journal`]: the node's durable record of its mounts (records in memory,
//!   group-committed ahead of the plugin calls of each planning pass).

pub mod beneath;
pub mod clock;
pub mod copy;
pub(crate) mod fence;
pub(crate) mod freeze;
pub(crate) mod guard;
pub(crate) mod health;
pub mod helpers;
pub(crate) mod holders;
pub mod host;
pub mod identity;
pub mod install;
pub mod journal;
pub mod leases;
pub mod mounts;
pub mod usage;
