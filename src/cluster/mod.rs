//! The cluster's shared records, kept in Nomad Variables, and the cluster-wide operations
//! that act on them.
//!
//! - [`catalog`]: the cluster-wide volume records, watched in Nomad Variables (and the
//!   follow loop the snapshot records share);
//! - [`changes`]: the change marker every record writer updates and every agent follows;
//! - [`trust`]: operator signatures on volume records and snapshot requests, verified by
//!   agents;
//! - [`claim_release`]: an operator's signed release of a node's claim (`volume claim
//!   release`), one of the evidences for hand-over;
//! - [`unpublish_request`]: an operator's signed request that one node unpublish a volume
//!   (`volume unpublish -node N -force`), answered by that node's agent in the same variable;
//! - `claims`: single-node access modes enforced across nodes with Nomad Variables locks;
//! - [`worker`]: which node runs a cluster-wide storage operation, taken by check-and-set;
//! - [`snapshot`]: snapshot records and the plugin calls that make, remove and clone from
//!   them;
//! - [`expansion`]: growing a volume (`volume create` again with a larger `capacity_min`);
//! - [`nodes`]: the node records each agent publishes (plugins, health, last seen);
//! - [`mounted`]: where a volume is still mounted, from those records and its claim (no
//!   delete under a live mount).

pub mod catalog;
pub mod changes;
pub mod claim_release;
pub(crate) mod claims;
pub mod expansion;
pub mod mounted;
pub mod nodes;
pub mod snapshot;
pub mod trust;
pub mod unpublish_request;
pub mod worker;
