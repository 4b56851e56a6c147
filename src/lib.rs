//! dhv-binder: deferred binding for Nomad dynamic host volumes.
//!
//! A per-node daemon that publishes network storage on the node where a task that needs it
//! is about to start, and unpublishes it when the last allocation using it is finished.
//!
//! Layout (one module per concept):
//! - [`config`]: typed settings, the Nomad CLI's environment conventions;
//! - [`nomad`]: the Nomad HTTP API client and wire types ([`nomad::types`], [`nomad::events`]);
//! - [`watch`]: the allocation watcher state machine (list, then event stream);
//! - `view`: this node's allocations and the deferred volumes they request;
//! - `catalog`: the cluster-wide volume records, watched in Nomad Variables;
//! - `claims`: single-node access modes enforced across nodes with Nomad Variables locks;
//! - [`volume`]: volume specs, records, keys and identifier validation;
//! - [`snapshot`]: snapshot records and the plugin calls that make, remove and clone from them;
//! - [`expansion`]: growing a volume (`volume create` again with a larger `capacity_min`);
//! - [`worker`]: which node runs a cluster-wide storage operation, taken by check-and-set;
//! - [`trust`]: operator signatures on volume records and snapshot requests, verified by agents;
//! - `reconcile`: the pure plan from what is known to the steps to take;
//! - [`journal`]: the durable local record (records in memory, group-committed ahead of
//!   the plugin calls of each planning pass);
//! - [`mounts`]: the mount table ([`mounts::MountTable`]), read as bytes, notice of its
//!   changes ([`mounts::MountChanges`]), and the kernel's answer whether one mount is in use
//!   ([`mounts::busy`]);
//! - [`host`]: the host's mount namespace (the agent must run in it) and resolved directories;
//! - `guard`: the read-only guard that keeps unpublished placeholders unwritable;
//! - `holders`: the processes still using a published volume;
//! - `gate`: the tasks that could start on a deferred volume before it is published;
//! - [`escape`]: terminal-safe text from plugins, callers and Nomad;
//! - [`plugin`]: the plugin runner (DHV protocol extended with publish/unpublish);
//! - `executor`: carries out one effect (plugin or Nomad call), returns a typed completion;
//! - [`environment`]: the plugin environment contract (variables of each operation);
//! - `retry`: exponential backoff with jitter, one retry table keyed by what is retried;
//! - `discovery`: notices plugin files added, changed or removed;
//! - [`nodes`]: the node records each agent publishes (plugins, health, last seen);
//! - [`metrics`]: Prometheus metrics, their update API and the scrape endpoint;
//! - `health`: the mount probe (`stat` with a timeout) and the lazy detach;
//! - `conformance`: the plugin conformance kit (`dhv-binder plugin check`);
//! - [`agent`]: a pure core (`handle(inputs, now) -> effects`; decisions in files named
//!   after them: waiters, claims, placeholders, workers, mount_health, retry) and the
//!   shell, the one place that performs effects;
//! - `identity`: workload identity token verification (JWKS);
//! - [`api`]: the local API on a unix socket, and its client;
//! - [`cli`]: the command line (one file per command group, [`cli::output`] for its forms).
#![forbid(unsafe_code)]

pub mod agent;
pub mod api;
pub mod catalog;
pub(crate) mod claims;
pub mod cli;
pub mod config;
pub(crate) mod conformance;
pub(crate) mod discovery;
pub mod environment;
pub mod escape;
pub(crate) mod executor;
pub mod expansion;
pub(crate) mod gate;
pub(crate) mod guard;
pub(crate) mod health;
pub(crate) mod holders;
pub mod host;
pub mod identity;
pub mod journal;
pub mod metrics;
pub mod mounts;
pub mod nodes;
pub mod nomad;
pub mod plugin;
pub(crate) mod reconcile;
pub(crate) mod retry;
pub mod snapshot;
pub mod trust;
pub(crate) mod view;
pub mod volume;
pub mod watch;
pub mod worker;
