//! The core's side of an operator's forced unpublish ([`crate::agent::forced`]): taking a
//! request, killing the holders, the unpublish's outcome in the journal, the log and the
//! answer the operator's CLI waits for.

use super::Core;
use crate::agent::effect::Effect;
use crate::agent::forced::{done_message, Start};
use crate::cluster::unpublish_request::{RequestState, UnpublishRequest};
use crate::node::fence::FenceReport;
use crate::node::journal::EventKind;
use crate::volume::VolumeKey;
use std::collections::BTreeSet;
use std::time::Instant;

impl Core {
    /// The allocations running with `volume` on this node (their tasks not finished).
    fn running_with(&self, volume: &VolumeKey) -> BTreeSet<String> {
        self.view
            .needing(volume)
            .filter(|id| {
                self.view
                    .allocs()
                    .get(&**id)
                    .is_some_and(|a| !a.tasks_finished())
            })
            .map(|id| id.to_string())
            .collect()
    }

    /// Acts on the requests naming this node (each once).
    pub(super) fn on_unpublish_requests(
        &mut self,
        requests: Vec<UnpublishRequest>,
        now: Instant,
        out: &mut Vec<Effect>,
    ) {
        for request in requests {
            let volume = request.volume.clone();
            let mounted = self.journal.mounts().contains_key(&volume);
            let busy = self.busy.contains(&volume);
            let users = self.running_with(&volume);
            let who = request.who();
            let Some(start) = self
                .forced
                .start(request.clone(), mounted, busy, users.clone(), now)
            else {
                continue;
            };
            match start {
                Start::Answer(state, message) => {
                    tracing::warn!(%volume, requested_by = %who, request = %request.id, outcome = state.as_str(), "operator's forced unpublish: {message}");
                    self.note_forced(&request, state, &message, "");
                    out.push(Effect::AnswerUnpublish {
                        request: Box::new(request),
                        state,
                        message,
                    });
                }
                Start::Kill | Start::Unpublish => {
                    let list: Vec<&str> = users.iter().map(String::as_str).collect();
                    tracing::warn!(%volume, requested_by = %who, request = %request.id, kill = request.kill, allocations = %list.join(", "), "operator forces the unpublish of the volume on this node (`volume unpublish -force`); its allocations here lose it");
                    self.dirty.insert(volume.clone());
                    if start == Start::Kill {
                        if let Some(m) = self.journal.mounts().get(&volume) {
                            let target = m.target.clone();
                            self.busy.insert(volume.clone());
                            out.push(Effect::KillHolders { volume, target });
                        }
                    }
                }
            }
        }
    }

    /// The holders were killed: the plan unpublishes next.
    pub(super) fn on_holders_killed(&mut self, volume: VolumeKey, report: FenceReport) {
        self.busy.remove(&volume);
        self.dirty.insert(volume.clone());
        if report.complete() {
            tracing::warn!(%volume, holders = %report.summary(), "forced unpublish: the processes holding the volume were killed");
        } else {
            tracing::error!(%volume, holders = %report.summary(), "forced unpublish: not every process holding the volume could be killed; the unpublish refuses while one remains");
        }
        self.forced.killed(&volume, report.summary());
    }

    /// The volume's unpublish finished (`refused`: its report when it failed): answers the
    /// forced unpublish it carried out, if any.
    pub(super) fn on_forced_unpublished(
        &mut self,
        volume: &VolumeKey,
        refused: Option<String>,
        out: &mut Vec<Effect>,
    ) {
        let users = self
            .forced
            .withdrawn()
            .get(volume)
            .cloned()
            .unwrap_or_default();
        let Some(a) = self.forced.unpublished(volume, refused.is_none()) else {
            return;
        };
        let (state, message) = match refused {
            None => (RequestState::Done, done_message(&a, &users)),
            Some(why) => (
                RequestState::Refused,
                format!(
                    "the unpublish of volume {volume} on node {} was refused; the volume stays published for its allocations: {why}{}",
                    a.request.node_id,
                    if a.request.kill {
                        ""
                    } else {
                        " (give -kill to kill the processes holding it, as the fence does)"
                    }
                ),
            ),
        };
        tracing::warn!(%volume, requested_by = %a.request.who(), request = %a.request.id, outcome = state.as_str(), "operator's forced unpublish: {message}");
        self.note_forced(&a.request, state, &message, &a.killed);
        out.push(Effect::AnswerUnpublish {
            request: Box::new(a.request),
            state,
            message,
        });
    }

    /// The audit record: a `forced-unpublish` event in the journal (who asked, whether the
    /// holders were to be killed, what was killed, the outcome), in the recent history
    /// `volume status -verbose` shows.
    fn note_forced(
        &mut self,
        request: &UnpublishRequest,
        state: RequestState,
        message: &str,
        killed: &str,
    ) {
        let who = request.who();
        self.journal.note(
            EventKind::ForcedUnpublish,
            &request.volume,
            serde_json::json!({
                "requested_by": who,
                "request_id": request.id,
                "kill": request.kill,
                "killed": killed,
                "outcome": state.as_str(),
                "message": message,
            }),
        );
        let mut detail = format!("by {who}, {}", state.as_str());
        if !killed.is_empty() {
            detail.push_str(&format!("; {killed}"));
        }
        self.journal
            .describe_last(&request.volume, detail, state == RequestState::Refused);
    }

    /// Gives up the requests whose unpublish has not come within
    /// [`crate::agent::forced::GIVE_UP_AFTER`]: answered `refused` with what the plan says
    /// of the volume, which goes back to its allocations.
    pub(super) fn give_up_forced(&mut self, now: Instant, out: &mut Vec<Effect>) {
        for a in self.forced.give_up(now) {
            let volume = a.request.volume.clone();
            self.dirty.insert(volume.clone());
            let why = self
                .waiting
                .iter()
                .find(|w| w.volume == volume)
                .map(|w| w.reason.clone())
                .or_else(|| self.last_error.get(&volume).cloned())
                .unwrap_or_else(|| "no unpublish ran (another allocation here may need it)".into());
            let message = format!(
                "volume {volume} was not unpublished on node {} within {} s; given back to its allocations: {why}",
                a.request.node_id,
                crate::agent::forced::GIVE_UP_AFTER.as_secs()
            );
            tracing::warn!(%volume, requested_by = %a.request.who(), request = %a.request.id, "operator's forced unpublish given up: {message}");
            self.note_forced(&a.request, RequestState::Refused, &message, &a.killed);
            out.push(Effect::AnswerUnpublish {
                request: Box::new(a.request),
                state: RequestState::Refused,
                message,
            });
        }
    }

    /// Forgets the withdrawn allocations that no longer run here.
    pub(super) fn forget_ended_withdrawals(&mut self) {
        let view = &self.view;
        self.forced
            .forget_ended(|id| view.allocs().get(id).is_some_and(|a| !a.tasks_finished()));
    }
}
