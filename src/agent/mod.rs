//! The agent: one pure core that owns all node state and decides everything, and a thin
//! shell that performs what it decides.
//!
//! - `core`: the state machine (`handle(input, now) -> effects`, `next_wakeup`);
//! - `input` / `effect`: what goes in (messages, typed completions) and what comes out;
//! - decisions, by what they decide: `waiters` (the answer to a prestart caller, "publish
//!   timed out"), `claims` (renewal timing, "claim lost"), `claim_waits` (which allocations
//!   wait for another node's claim, since when), `placeholders`, `offer` (attach limits, cool-downs: volumes withheld here),
//!   `workers`
//!   (volume create/delete), `storage_ops` (snapshots, expansions, the publish that waits
//!   for an expansion), `forced` (an operator's forced unpublish on this node),
//!   `mount_health` (dead, failing and hung mounts), `retry`
//!   (one backoff table for every kind of work), `latency`;
//! - `shell`: the loop, the one place that performs effects; `meter`: what it measures
//!   for the metrics (counts of what the core decided, timings of what the shell ran);
//!   `after_calls`: when the shell reads the mount table for plugin calls that finished;
//!   `holder_watch`: the waits on the processes a refused unpublish named.
//!
//! The publish/unpublish plan itself is `crate::agent::reconcile` (with "allocation lost while
//! its tasks still run" decided in `crate::agent::view` and `crate::agent::reconcile`).

pub(crate) mod after_calls;
pub(crate) mod claim_waits;
pub(crate) mod claims;
pub(crate) mod core;
pub(crate) mod effect;
pub(crate) mod executor;
pub(crate) mod forced;
pub(crate) mod gate;
pub(crate) mod holder_watch;
pub(crate) mod input;
pub(crate) mod journal_trouble;
pub(crate) mod latency;
#[cfg(test)]
mod memory_budget;
pub(crate) mod meter;
pub(crate) mod mount_health;
pub(crate) mod offer;
pub(crate) mod placeholders;
pub(crate) mod reconcile;
pub(crate) mod refresh;
pub(crate) mod renewer;
pub(crate) mod retry;
pub(crate) mod secret_watch;
pub(crate) mod shell;
pub(crate) mod storage_ops;
pub(crate) mod view;
pub(crate) mod volume_usage;
pub(crate) mod waiters;
pub(crate) mod workers;

pub use shell::{run, StartError};
