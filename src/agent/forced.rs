//! An operator's forced unpublish on this node (`volume unpublish -node N -force`,
//! [`crate::cluster::unpublish_request`]): which request is being carried out, in which
//! phase, and which allocations the volume was withdrawn from.
//!
//! Rules (docs/operations/claims.md, "Unpublishing a volume on one node"):
//! - each verified request naming this node is acted on once (by its ID);
//! - a request for a volume not mounted here is answered `done` ("not mounted"); one for a
//!   volume with a publish or unpublish in flight is refused (ask again);
//! - with `kill`, the processes holding the mount are killed first, as the fence kills
//!   them ([`crate::node::fence::fence`]: by cgroup identity, never the agent), then the
//!   volume is unpublished; without it, the unpublish refuses while a process holds the
//!   mount, and the request is answered `refused` naming the holders (the volume stays);
//! - the allocations that were running with the volume here when the request was acted on
//!   lose it and do not get it published again while they run (the operator asked for it
//!   to go); a new allocation publishes it as usual. An agent restart forgets the
//!   withdrawal: a still-running allocation then gets the volume published again;
//! - a request whose unpublish has not come [`GIVE_UP_AFTER`] after it was taken (an
//!   allocation placed meanwhile needs the volume, its plugin is gone) is given up: answered
//!   `refused` with the plan's reason, the volume given back to its allocations.

use crate::cluster::unpublish_request::{RequestState, UnpublishRequest};
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// How long a request may be carried out before it is given up (answered `refused`, the
/// volume given back to its allocations): the plan may never unpublish it (an allocation
/// placed meanwhile needs it, the plugin is gone, the picture stays incomplete).
pub(crate) const GIVE_UP_AFTER: Duration = Duration::from_secs(120);

/// Where a request being carried out stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The holders are being killed ([`crate::agent::effect::Effect::KillHolders`]).
    Killing,
    /// The plan unpublishes the volume (its allocations here are withdrawn from it).
    Unpublishing,
}

/// One request being carried out.
#[derive(Debug, Clone)]
pub(crate) struct Active {
    pub request: UnpublishRequest,
    pub phase: Phase,
    /// What the kill did, for the answer and the journal (empty before, or without `kill`).
    pub killed: String,
    /// When the node took it.
    pub started: Instant,
}

/// The forced unpublishes of this node.
#[derive(Debug, Default)]
pub(crate) struct Forced {
    /// Requests acted on, by ID: each is answered once.
    seen: BTreeSet<String>,
    /// The request being carried out, by volume.
    active: BTreeMap<VolumeKey, Active>,
    /// Allocations the operator withdrew each volume from: not published for them again.
    withdrawn: BTreeMap<VolumeKey, BTreeSet<String>>,
}

/// What to do about a new request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// Answer at once (nothing to unpublish, or refused).
    Answer(RequestState, String),
    /// Kill the holders first.
    Kill,
    /// Unpublish now.
    Unpublish,
}

impl Forced {
    /// Takes a request naming this node, fresh and pending (the shell filtered those).
    /// `None` when it was acted on before. `mounted`: the volume has a mount record here;
    /// `busy`: a call on it is in flight; `users`: the allocations running with it here.
    pub(crate) fn start(
        &mut self,
        request: UnpublishRequest,
        mounted: bool,
        busy: bool,
        users: BTreeSet<String>,
        now: Instant,
    ) -> Option<Start> {
        if !self.seen.insert(request.id.clone()) || self.active.contains_key(&request.volume) {
            return None;
        }
        let node = request.node_id.clone();
        let volume = request.volume.clone();
        if !mounted {
            return Some(Start::Answer(
                RequestState::Done,
                format!("volume {volume} is not mounted on node {node}: nothing to unpublish"),
            ));
        }
        if busy {
            return Some(Start::Answer(
                RequestState::Refused,
                format!("a publish or unpublish of volume {volume} is in flight on node {node}; nothing was done: ask again in a moment"),
            ));
        }
        let kill = request.kill;
        self.withdrawn
            .entry(volume.clone())
            .or_default()
            .extend(users);
        self.active.insert(
            volume,
            Active {
                request,
                phase: if kill {
                    Phase::Killing
                } else {
                    Phase::Unpublishing
                },
                killed: String::new(),
                started: now,
            },
        );
        Some(if kill { Start::Kill } else { Start::Unpublish })
    }

    /// The holders were killed (`summary`: the fence report's): the unpublish follows.
    pub(crate) fn killed(&mut self, volume: &VolumeKey, summary: String) -> bool {
        match self.active.get_mut(volume) {
            Some(a) if a.phase == Phase::Killing => {
                a.phase = Phase::Unpublishing;
                a.killed = summary;
                true
            }
            _ => false,
        }
    }

    /// The volume's unpublish finished: the request it carried out, if any. A refused
    /// unpublish gives the volume back to its allocations.
    pub(crate) fn unpublished(&mut self, volume: &VolumeKey, ok: bool) -> Option<Active> {
        let a = self.active.remove(volume)?;
        if !ok {
            self.withdrawn.remove(volume);
        }
        Some(a)
    }

    /// Gives up the requests carried out for [`GIVE_UP_AFTER`] or longer without their
    /// unpublish finishing (not while their kill runs): each volume is given back to its
    /// allocations.
    pub(crate) fn give_up(&mut self, now: Instant) -> Vec<Active> {
        let late: Vec<VolumeKey> = self
            .active
            .iter()
            .filter(|(_, a)| {
                a.phase == Phase::Unpublishing
                    && now.saturating_duration_since(a.started) >= GIVE_UP_AFTER
            })
            .map(|(k, _)| k.clone())
            .collect();
        late.iter()
            .filter_map(|k| {
                self.withdrawn.remove(k);
                self.active.remove(k)
            })
            .collect()
    }

    /// The allocations each volume is withdrawn from (the plan publishes nothing for them).
    pub(crate) fn withdrawn(&self) -> &BTreeMap<VolumeKey, BTreeSet<String>> {
        &self.withdrawn
    }

    /// Forgets the withdrawn allocations that no longer run (`running` says).
    pub(crate) fn forget_ended(&mut self, running: impl Fn(&str) -> bool) {
        for ids in self.withdrawn.values_mut() {
            ids.retain(|id| running(id));
        }
        self.withdrawn
            .retain(|k, ids| !ids.is_empty() || self.active.contains_key(k));
    }
}

/// The answer of a forced unpublish that finished, for the operator.
pub(crate) fn done_message(a: &Active, users: &BTreeSet<String>) -> String {
    let mut s = format!(
        "unpublished volume {} on node {}",
        a.request.volume, a.request.node_id
    );
    if !a.killed.is_empty() {
        s.push_str(&format!(" (holders: {})", a.killed));
    }
    if users.is_empty() {
        s.push_str("; no allocation here was running with it");
    } else {
        let list: Vec<&str> = users.iter().map(String::as_str).collect();
        s.push_str(&format!(
            "; allocations {} lost the volume and do not get it back while they run (a new allocation publishes it again)",
            list.join(", ")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        Instant::now()
    }

    /// A request whose unpublish never comes is given up after [`GIVE_UP_AFTER`], and its
    /// volume given back; one whose holders are still being killed is not.
    #[test]
    fn a_request_that_never_unpublishes_is_given_up() {
        let mut f = Forced::default();
        let t = t0();
        let users = BTreeSet::from(["a1".to_string()]);
        f.start(req("r", false), true, false, users.clone(), t);
        let mut k = req("k", true);
        k.volume.name = "other".into();
        f.start(k, true, false, users, t);
        assert!(f.give_up(t + GIVE_UP_AFTER / 2).is_empty());
        let gone = f.give_up(t + GIVE_UP_AFTER);
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert_eq!(gone[0].request.id, "r");
        assert!(!f.withdrawn().contains_key(&req("r", false).volume));
        assert!(
            f.withdrawn().keys().any(|k| k.name == "other".into()),
            "the kill still runs"
        );
    }

    fn req(id: &str, kill: bool) -> UnpublishRequest {
        UnpublishRequest::new(
            VolumeKey {
                namespace: "default".into(),
                name: "data".into(),
            },
            "node-a".into(),
            kill,
            id.into(),
            1,
            "ops".into(),
        )
    }

    #[test]
    fn a_request_is_acted_on_once_and_a_refusal_gives_the_volume_back() {
        let mut f = Forced::default();
        let users = BTreeSet::from(["a1".to_string()]);
        assert_eq!(
            f.start(req("r1", false), true, false, users.clone(), t0()),
            Some(Start::Unpublish)
        );
        assert_eq!(
            f.start(req("r1", false), true, false, users.clone(), t0()),
            None
        );
        let key = req("r1", false).volume;
        assert_eq!(f.withdrawn()[&key], users);
        assert!(f.unpublished(&key, false).is_some());
        assert!(
            f.withdrawn().is_empty(),
            "refused: the volume is theirs again"
        );
    }

    #[test]
    fn kill_comes_before_the_unpublish_and_the_withdrawal_ends_with_its_allocations() {
        let mut f = Forced::default();
        let key = req("r", true).volume;
        let users = BTreeSet::from(["a1".to_string()]);
        assert_eq!(
            f.start(req("r", true), true, false, users, t0()),
            Some(Start::Kill)
        );
        assert!(f.killed(&key, "killed 42 (sh)".into()));
        let a = f.unpublished(&key, true).unwrap();
        assert_eq!(a.killed, "killed 42 (sh)");
        assert!(f.withdrawn().contains_key(&key));
        f.forget_ended(|_| false);
        assert!(f.withdrawn().is_empty());
    }

    #[test]
    fn not_mounted_is_done_and_in_flight_is_refused() {
        let mut f = Forced::default();
        assert!(matches!(
            f.start(req("a", false), false, false, BTreeSet::new(), t0()),
            Some(Start::Answer(RequestState::Done, _))
        ));
        assert!(matches!(
            f.start(req("b", false), true, true, BTreeSet::new(), t0()),
            Some(Start::Answer(RequestState::Refused, _))
        ));
        assert!(f.withdrawn().is_empty());
    }
}
