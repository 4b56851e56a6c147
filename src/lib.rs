//! dhv-binder: deferred binding for Nomad dynamic host volumes.
//!
//! A per-node daemon that publishes network storage on the node where a task that needs it
//! is about to start, and unpublishes it when the last allocation using it is finished.
//!
//! Layout (one module per concept):
//! - [`config`]: typed settings, the Nomad CLI's environment conventions;
//! - [`nomad`]: the Nomad HTTP API client and wire types ([`nomad::types`], [`nomad::events`]);
//! - [`watch`]: the allocation watcher state machine (list, then event stream);
//! - [`view`]: this node's allocations and the deferred volumes they request;
//! - [`catalog`]: the cluster-wide volume records, watched in Nomad Variables;
//! - [`claims`]: single-node access modes enforced across nodes with Nomad Variables locks;
//! - [`volume`]: volume specs, records, keys and identifier validation;
//! - [`snapshot`]: snapshot records and the plugin calls that make, remove and clone from them;
//! - [`expansion`]: growing a volume (`volume create` again with a larger `capacity_min`);
//! - [`worker`]: which node runs a cluster-wide storage operation, taken by check-and-set;
//! - [`reconcile`]: the pure plan from what is known to the steps to take;
//! - [`journal`]: the durable local record, written ahead of every plugin call;
//! - [`mounts`]: the mount table;
//! - [`plugin`]: the plugin runner (DHV protocol extended with publish/unpublish);
//! - [`executor`]: carries out one step as a task and reports its completion;
//! - [`discovery`]: notices plugin files added, changed or removed;
//! - [`health`]: probes published mounts, republishes dead FUSE mounts;
//! - [`conformance`]: the plugin conformance kit (`dhv-binder plugin check`);
//! - [`agent`]: the owner loop tying them together;
//! - [`identity`]: workload identity token verification (JWKS);
//! - [`api`]: the local API on a unix socket, and its client;
//! - [`cli`]: the command line.
#![forbid(unsafe_code)]

pub mod agent;
pub mod api;
pub mod catalog;
pub mod claims;
pub mod cli;
pub mod config;
pub mod conformance;
pub mod discovery;
pub mod executor;
pub mod expansion;
pub mod health;
pub mod identity;
pub mod journal;
pub mod mounts;
pub mod nomad;
pub mod plugin;
pub mod reconcile;
pub mod snapshot;
pub mod view;
pub mod volume;
pub mod watch;
pub mod worker;
