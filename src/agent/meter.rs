//! What the shell measures for the metrics (`crate::metrics`). The meter sees every input
//! before the core does, every effect the shell performs and every journal commit, and
//! reads the core's counts after each pass. It decides nothing: it counts what the core's
//! decisions say (an `Effect::Detach` is "a published mount found dead", a renewal answered
//! `ClaimError::Lost` is "claim lost", an `Effect::Reply` to a prestart caller ends its
//! publish wait unless it is a progress report; the allocations waiting for a claim are the
//! core's `claim_waits`).
//!
//! Nothing here grows with the node per pass: counts are kept as things happen; the
//! mounts by state are counted again only after a pass that commits (a commit already
//! writes every mount record), the claims by state only when they changed (the claims'
//! version moved), and the volumes this node serves only when the catalogue or the
//! plugins changed.

use crate::agent::core::Core;
use crate::agent::effect::{Answer, Effect};
use crate::agent::executor::{StepError, WorkerError};
use crate::agent::input::{ApiCall, Completion, Input, ReplyId};
use crate::api::{ApiError, PublishReply};
use crate::cluster::claims::ClaimError;
use crate::metrics::{ClaimCounts, Metrics, Outcome, WaitOutcome};
use crate::storage::plugin::{CallObserver, PluginError};
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a prestart caller's wait ended, from the answer it gets.
pub(crate) fn wait_outcome(r: &Result<PublishReply, ApiError>) -> WaitOutcome {
    match r {
        Ok(_) => WaitOutcome::Published,
        // The answers given when the caller's deadline passed first (agent/waiters.rs).
        Err(
            ApiError::NotPublishedInTime { .. }
            | ApiError::AllocationNotSeen { .. }
            | ApiError::Waiting(_),
        ) => WaitOutcome::TimedOut,
        Err(_) => WaitOutcome::Failed,
    }
}

/// The shell's counts behind the metrics.
#[derive(Debug)]
pub(crate) struct Meter {
    metrics: Metrics,
    /// When each waiting prestart caller arrived (or, for a call after a progress report,
    /// when the first call of that wait did).
    arrived: HashMap<ReplyId, Instant>,
    /// Allocations whose last call ended with a progress report: when their wait began (the
    /// next call carries it on; dropped after [`crate::api::MAX_WAIT`] if none comes).
    carried: HashMap<String, Instant>,
    /// Claim waits begun as last counted.
    claim_waits: u64,
    /// Mount records by state (publishing, published, unpublishing) as last counted.
    mounts: [usize; 3],
    /// Published mounts found dead and not published again yet.
    dead: BTreeSet<VolumeKey>,
    /// Volumes whose last plugin call timed out: its effect is unknown until the next one.
    uncertain: BTreeSet<VolumeKey>,
    /// Creates and deletes running.
    workers: usize,
    /// Volume records this node serves, as last counted.
    served: usize,
    /// The claims' version when they were last counted (`None`: never).
    claims_counted: Option<u64>,
    /// A commit was issued in this pass: count the mounts again.
    recount_mounts: bool,
    /// The catalogue or the plugins changed in this pass: count what this node serves.
    recount_served: bool,
    plugins_changed: bool,
    /// The attach counts last exported.
    attach: BTreeMap<String, crate::cluster::nodes::AttachCount>,
}

impl Meter {
    pub(crate) fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            arrived: HashMap::new(),
            carried: HashMap::new(),
            claim_waits: 0,
            mounts: [0; 3],
            dead: BTreeSet::new(),
            uncertain: BTreeSet::new(),
            workers: 0,
            served: 0,
            claims_counted: None,
            recount_mounts: true,
            recount_served: true,
            plugins_changed: false,
            attach: BTreeMap::new(),
        }
    }

    /// Times every plugin call the runner makes (fingerprints included).
    pub(crate) fn plugin_observer(&self) -> CallObserver {
        let m = self.metrics.clone();
        Arc::new(
            move |plugin: &str, op, error: Option<&PluginError>, elapsed: Duration| {
                m.plugin_call(plugin, op, Outcome::of_error(error), elapsed)
            },
        )
    }

    /// Counts the processes plugin calls leave behind.
    pub(crate) fn plugin_leftover_observer(&self) -> crate::storage::plugin::LeftoverObserver {
        let m = self.metrics.clone();
        Arc::new(move |plugin: &str, op, fate, n| m.plugin_leftovers(plugin, op, fate, n))
    }

    /// An input on its way to the core.
    pub(crate) fn input(&mut self, i: &Input) {
        match i {
            Input::Api {
                reply,
                call: ApiCall::Publish(req),
            } => {
                let now = Instant::now();
                self.carried
                    .retain(|_, t| now.duration_since(*t) < crate::api::MAX_WAIT);
                let began = self.carried.remove(&req.alloc_id).unwrap_or(now);
                self.arrived.insert(*reply, began);
            }
            Input::CallerGone(reply) => {
                self.arrived.remove(reply);
            }
            Input::Catalogue(_) => self.recount_served = true,
            Input::Committed { result, .. } => self.metrics.journal_write_result(result.is_ok()),
            Input::Done(c) => self.completion(c),
            _ => {}
        }
    }

    fn completion(&mut self, c: &Completion) {
        let plugin_error = |e: Option<&StepError>| match e {
            Some(StepError::Plugin(e)) => Some(e.is_uncertain()),
            Some(_) => Some(false),
            None => None,
        };
        match c {
            Completion::Published { volume, result, .. } => {
                if result.is_ok() {
                    self.dead.remove(volume);
                }
                self.settled(volume, plugin_error(result.as_ref().err()));
            }
            Completion::Unpublished { volume, result } => {
                if result.is_ok() {
                    self.dead.remove(volume);
                }
                self.settled(volume, plugin_error(result.as_ref().err()));
            }
            Completion::Worker { volume, result } => {
                self.workers = self.workers.saturating_sub(1);
                let timed_out = match result {
                    Err(WorkerError::Plugin(e)) => Some(e.is_uncertain()),
                    Err(_) => Some(false),
                    Ok(()) => None,
                };
                self.settled(volume, timed_out);
            }
            Completion::ClaimRenewed {
                result: Err(ClaimError::Lost { .. }),
                ..
            } => self.metrics.claim_lost(),
            Completion::Plugins(_) => {
                self.plugins_changed = true;
                self.recount_served = true;
            }
            _ => {}
        }
    }

    /// A call on `volume` ended: `Some(true)` when it timed out.
    fn settled(&mut self, volume: &VolumeKey, timed_out: Option<bool>) {
        if timed_out == Some(true) {
            self.uncertain.insert(volume.clone());
        } else {
            self.uncertain.remove(volume);
        }
    }

    /// An effect the shell is about to perform.
    pub(crate) fn effect(&mut self, e: &Effect) {
        match e {
            Effect::Detach { volume, .. } => {
                self.metrics.mount_died();
                self.dead.insert(volume.clone());
            }
            Effect::Fence { .. } => self.metrics.claim_fenced(),
            Effect::Create(_) | Effect::Delete(_) => self.workers += 1,
            Effect::Commit { .. } => self.recount_mounts = true,
            Effect::Reply {
                to,
                answer: Answer::Publish(r),
            } => {
                match (self.arrived.remove(to), r) {
                    // A progress report: the wait goes on in the caller's next call.
                    (Some(t), Ok(reply)) if reply.waiting.is_some() => {
                        self.carried.insert(reply.alloc_id.clone(), t);
                    }
                    (Some(t), r) => self.metrics.publish_wait(wait_outcome(r), t.elapsed()),
                    (None, _) => {}
                }
            }
            _ => {}
        }
    }

    /// One journal commit (write, fsync, rename, fsync of the directory) took `elapsed`.
    pub(crate) fn committed(&self, elapsed: Duration) {
        self.metrics.journal_write(elapsed);
    }

    /// After each pass: the gauges.
    pub(crate) fn after_pass(&mut self, core: &Core) {
        if std::mem::take(&mut self.recount_mounts) {
            self.mounts = core.mounts_by_state();
        }
        let [publishing, published, unpublishing] = self.mounts;
        self.metrics.set_pending(
            publishing + unpublishing + self.workers,
            self.uncertain.len(),
            self.arrived.len(),
        );
        self.metrics
            .set_mounts(publishing, published, unpublishing, self.dead.len());
        self.metrics.set_watch(core.watch_health());
        let attach = core.attach_counts();
        if attach != self.attach {
            self.metrics.set_attach(&attach);
            self.attach = attach;
        }
        if self.plugins_changed {
            if let Some(p) = core.plugins() {
                self.metrics.set_plugins(p);
                self.plugins_changed = false;
            }
        }
        if self.claims_counted != Some(core.claims_version()) {
            let ([held, fenced, lost, waiting], version) = core.claims_by_state();
            self.metrics.set_claims(ClaimCounts {
                held,
                fenced,
                lost,
                waiting,
            });
            self.claims_counted = Some(version);
        }
        let (begun, current, oldest) = core.claim_waits();
        self.metrics
            .claim_waits(begun.saturating_sub(self.claim_waits), current, oldest);
        self.claim_waits = begun;
        if std::mem::take(&mut self.recount_served) {
            self.served = core.volumes_served();
        }
        self.metrics.set_frozen(core.frozen_count());
        let (allocations, volumes) = core.known();
        self.metrics.set_known(allocations, volumes, self.served);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_answered_at_its_deadline_timed_out_and_others_failed_or_published() {
        let ok = Ok(PublishReply {
            alloc_id: "a".into(),
            volumes: Vec::new(),
            waiting: None,
        });
        assert_eq!(wait_outcome(&ok), WaitOutcome::Published);
        let late = Err(ApiError::NotPublishedInTime {
            alloc_id: "a".into(),
        });
        assert_eq!(wait_outcome(&late), WaitOutcome::TimedOut);
        let waiting = Err(ApiError::Waiting("claim held".into()));
        assert_eq!(wait_outcome(&waiting), WaitOutcome::TimedOut);
        let failed = Err(ApiError::PublishFailed {
            volume: VolumeKey {
                namespace: "default".into(),
                name: "v".into(),
            },
            error: "exit 1".into(),
        });
        assert_eq!(wait_outcome(&failed), WaitOutcome::Failed);
    }
}
