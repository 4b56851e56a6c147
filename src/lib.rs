//! dhv-binder: deferred binding for Nomad dynamic host volumes.
//!
//! A per-node daemon that publishes network storage on the node where a task that needs it
//! is about to start, and unpublishes it when the last allocation using it is finished.
//!
//! Layout, by layer (each folder imports only from the folders above it in this list):
//! - cross-cutting: [`config`] (typed settings, the Nomad CLI's environment conventions),
//!   [`escape`] (terminal-safe text from plugins, callers and Nomad) and [`volume`] (volume
//!   specs, records, keys, identifier validation and [`volume::mount_options`]: the
//!   vocabulary every layer shares);
//! - [`nomad`]: Nomad's HTTP API (client, wire types, events, transport, `retry`: backoff
//!   with jitter for every loop that calls it), the allocation
//!   watcher ([`nomad::watch`]: list, then blocking queries or the event stream) and
//!   workload identity verification ([`nomad::identity`]);
//! - [`node`]: what this node's kernel says (mounts, host namespace, the read-only guard,
//!   holders, the mount probe) and its durable record of its mounts ([`node::journal`]);
//! - [`storage`]: the plugin runner, the plugin environment contract and plugin discovery;
//! - [`cluster`]: the records shared through Nomad Variables (volume catalog, signatures,
//!   claims, node records, snapshots, expansions, workers);
//! - [`agent`]: a pure core (`handle(inputs, now) -> effects`; decisions in files named
//!   after them, the reconcile plan, this node's view of its allocations, the gate) and the
//!   shell, the one place that performs effects (through the executor);
//! - [`metrics`]: Prometheus metrics, their update API and the scrape endpoint;
//! - [`api`]: the local API on a unix socket, and its client;
//! - `conformance`: the plugin conformance kit (`dhv-binder plugin check`);
//! - [`cli`]: the command line (one file per command group, [`cli::output`] for its forms).
#![forbid(unsafe_code)]

pub mod agent;
pub mod api;
pub mod cli;
pub mod cluster;
pub mod config;
pub(crate) mod conformance;
pub mod escape;
pub mod metrics;
pub mod node;
pub mod nomad;
pub mod storage;
pub mod volume;
