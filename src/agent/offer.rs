//! Decides which volumes this node withholds from Nomad's scheduler although it serves them:
//! a plugin at its attach limit (`max_volumes` volumes published here); a volume whose
//! publish cannot succeed here for a while (a failure of class "elsewhere", or
//! [`TRANSIENT_LIMIT`] transient failures in a row: a cool-down of [`COOL_DOWN`]); a volume
//! whose record holds a "final" failure (written by the node that saw it: every node
//! withholds it until an operator repairs it); a volume whose `constraint` blocks or
//! `topology_request` this node does not satisfy; a paused or drained volume. A
//! withheld volume has no placeholder here (so no `ready` host volume of its name: Nomad's
//! feasibility checker places elsewhere) and a publish of it here is refused at once, with
//! why; a volume published here is never withheld (its users keep it).

use crate::storage::error_class::ErrorClass;
use crate::storage::plugin::PluginError;
use crate::volume::final_failure::FinalFailure;
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// How long a node withholds a volume after a publish that cannot succeed here.
pub(crate) const COOL_DOWN: Duration = Duration::from_secs(300);

/// How often an agent reads its node's attributes and meta again (a node whose attributes
/// changed stops or starts offering constrained volumes within this long).
pub(crate) const NODE_REREAD: Duration = Duration::from_secs(30);

/// How long a node that matches none of a pending volume's preferred topologies waits
/// before it competes for the volume's create (a node that matches one takes it first).
pub(crate) const PREFER_GRACE: Duration = Duration::from_secs(10);

/// The most offer events kept per volume, and the most volumes with offer events (those
/// with the latest); the node record bounds them again with the journal's.
const EVENTS_PER_VOLUME: usize = 10;
const EVENT_VOLUMES: usize = 8;
/// The most characters of an offer event's detail.
const EVENT_DETAIL_CHARS: usize = 120;

/// A change of what this node offers (for `volume status -verbose`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OfferEvent {
    /// Unix seconds.
    pub time: u64,
    /// `cool-down` (withheld here after a failure), `final` (a failure of the class
    /// "final" seen here), `offered-again` (a cool-down ended, an operator repaired it) or
    /// `availability` (an operator paused, drained or reactivated a volume published here).
    pub event: &'static str,
    /// Why, cut to 120 characters: never the plugin's words (the event goes to the node
    /// record, which carries none: docs/security.md).
    pub detail: String,
}

/// Transient publish failures in a row on this node after which the volume cools down.
pub(crate) const TRANSIENT_LIMIT: u32 = 3;

/// The class of a plugin's failure: the `error_class` it printed, else its exit code
/// ([`ErrorClass::of_status`]); a timeout, a spawn failure and the like are transient.
pub(crate) fn class_of(e: &PluginError) -> ErrorClass {
    match e {
        PluginError::Failed { class: Some(c), .. } => *c,
        PluginError::Failed { status, .. } => ErrorClass::of_status(status),
        _ => ErrorClass::RetryHere,
    }
}

/// Why this node withholds a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Withheld {
    /// `published` of the plugin's volumes are published here, its limit is `max`.
    AttachLimit {
        plugin: String,
        published: usize,
        max: u32,
    },
    /// A publish here failed in a way that sends the job elsewhere, until `until`.
    /// `retried`: the failures were transient, so a publish for an allocation already
    /// here is still tried (with backoff); after "elsewhere" or "final" it is not.
    CoolingDown {
        until: Instant,
        error: String,
        retried: bool,
    },
    /// This node does not satisfy the volume's constraint (as written).
    Constraint(String),
    /// The volume has constraints and this node's attributes have not been read yet.
    NodeUnread,
    /// The plugin's topology here (`zone=a`, or `none`) matches none of the volume's
    /// required topologies (as written).
    Topology { here: String, required: String },
    /// An operator paused or drained the volume (`volume update -availability`).
    Unavailable(crate::volume::availability::Availability),
    /// A publish failed with the class "final" (the record's `final_failure`, on any node).
    Final(crate::volume::final_failure::FinalFailure),
}

impl Withheld {
    /// True for a cool-down after transient failures: a publish for an allocation already
    /// here is still tried.
    pub(crate) fn retried_here(&self) -> bool {
        matches!(self, Withheld::CoolingDown { retried: true, .. })
    }

    /// One line for the caller, the log and the status.
    pub(crate) fn reason(&self, now: Instant) -> String {
        match self {
            Withheld::AttachLimit {
                plugin,
                published,
                max,
            } => format!(
                "this node is at its attach limit for plugin {plugin:?} ({published} of {max} volumes published): the job is to run on another node"
            ),
            Withheld::Constraint(c) => {
                format!("this node does not satisfy the volume's constraint {c}")
            }
            Withheld::Unavailable(a) => format!(
                "paused by an operator (availability {a}): no new allocation gets the volume until `dhv-binder volume update -availability=active`"
            ),
            Withheld::Final(f) => f.reason(),
            Withheld::Topology { here, required } => format!(
                "this node's plugin topology ({here}) matches none of the volume's required topologies ({required})"
            ),
            Withheld::NodeUnread => "the volume has constraints and this node's attributes are not read yet (GET /v1/node/:id)".to_string(),
            Withheld::CoolingDown { until, error, .. } => format!(
                "{error} (offered here again in {}s)",
                until.saturating_duration_since(now).as_secs()
            ),
        }
    }
}

/// The cool-downs and transient failure counts of this node's volumes, and the "final"
/// failures seen here that are to be written into their records.
#[derive(Debug, Default)]
pub(crate) struct Offers {
    cooling: BTreeMap<VolumeKey, (Instant, String, bool)>,
    transient: BTreeMap<VolumeKey, u32>,
    /// Volume → its record's ID, the "final" failure seen here, and the record's
    /// ModifyIndex once it holds the failure (`None`: not written yet): withheld here until
    /// an operator clears it.
    finals: BTreeMap<VolumeKey, (String, FinalFailure, Option<u64>)>,
    /// The marks in flight.
    marking: BTreeSet<VolumeKey>,
    /// The recent changes of what this node offers, per volume (`volume status -verbose`).
    events: BTreeMap<VolumeKey, VecDeque<OfferEvent>>,
    /// Pending volumes with a preferred topology this node does not match: when this node
    /// first saw each ([`PREFER_GRACE`]).
    unpreferred: BTreeMap<VolumeKey, Instant>,
}

impl Offers {
    /// A publish of `volume` failed with `class` and the plugin's words `report`: true when
    /// the volume now cools down here (class "elsewhere", or the [`TRANSIENT_LIMIT`]th
    /// transient failure in a row). "final" is the volume's, not this node's: no cool-down
    /// (the caller records it, [`Offers::final_failed`]), true.
    pub(crate) fn publish_failed(
        &mut self,
        volume: &VolumeKey,
        class: ErrorClass,
        report: &str,
        now: Instant,
    ) -> bool {
        if class == ErrorClass::Final {
            return true;
        }
        let n = self.transient.entry(volume.clone()).or_insert(0);
        *n += 1;
        let cool = match class {
            ErrorClass::Elsewhere | ErrorClass::Final => true,
            ErrorClass::RetryHere => *n >= TRANSIENT_LIMIT,
        };
        if cool {
            self.transient.remove(volume);
            // No plugin words: the event goes to the node record (docs/security.md).
            self.note(
                volume,
                "cool-down",
                &format!(
                    "class {class}: withheld here for {}s (why: this node's log and status)",
                    COOL_DOWN.as_secs()
                ),
            );
            let error = match class {
                ErrorClass::RetryHere => {
                    format!("{report} ({TRANSIENT_LIMIT} times in a row)")
                }
                _ => report.to_string(),
            };
            let retried = class == ErrorClass::RetryHere;
            self.cooling
                .insert(volume.clone(), (now + COOL_DOWN, error, retried));
        }
        cool
    }

    /// A publish of the volume `volume_id` failed with the class "final": withheld here
    /// from now on, and the failure is to be written into its record (every node then
    /// withholds it), until an operator clears it ([`Offers::repaired`]). A failure already
    /// known for it is kept (the first words).
    pub(crate) fn final_failed(&mut self, volume: &VolumeKey, volume_id: &str, f: FinalFailure) {
        self.transient.remove(volume);
        if !self.finals.contains_key(volume) {
            self.note(
                volume,
                "final",
                "class final: written into the volume's record (why: volume status)",
            );
        }
        self.finals
            .entry(volume.clone())
            .or_insert_with(|| (volume_id.to_string(), f, None));
    }

    /// The "final" failure seen here of the volume `volume_id`, if any.
    pub(crate) fn final_seen(&self, volume: &VolumeKey, volume_id: &str) -> Option<&FinalFailure> {
        self.finals
            .get(volume)
            .filter(|(id, _, _)| id == volume_id)
            .map(|(_, f, _)| f)
    }

    /// The marks to write now (not written, not in flight, and `ready`: the backoff allows
    /// it), each then in flight until [`Offers::marked`].
    pub(crate) fn marks_due(
        &mut self,
        mut ready: impl FnMut(&VolumeKey) -> bool,
    ) -> Vec<(VolumeKey, String, FinalFailure)> {
        let due: Vec<_> = self
            .finals
            .iter()
            .filter(|(k, (_, _, at))| at.is_none() && !self.marking.contains(*k) && ready(k))
            .map(|(k, (id, f, _))| (k.clone(), id.clone(), f.clone()))
            .collect();
        self.marking.extend(due.iter().map(|(k, _, _)| k.clone()));
        due
    }

    /// A mark's write finished: `Some(index)`, the record holds the failure at that
    /// ModifyIndex; `None`, it failed and is tried again after the backoff.
    pub(crate) fn marked(&mut self, volume: &VolumeKey, at: Option<u64>) {
        self.marking.remove(volume);
        if let Some(x) = self.finals.get_mut(volume) {
            x.2 = x.2.or(at);
        }
    }

    /// Forgets the "final" failure seen here of `volume` (its record is gone).
    pub(crate) fn forget_final(&mut self, volume: &VolumeKey) {
        self.finals.remove(volume);
    }

    /// Compares the "final" failures seen here with the records (`record`: a volume's ID,
    /// ModifyIndex and whether it holds a failure; `None` when it has no record): one whose
    /// record is gone or is another volume now is forgotten; one whose record, at or after
    /// the index that held it, holds none any more was cleared by an operator and is
    /// [`Offers::repaired`] (even when no catalogue between showed it set). Returns those.
    pub(crate) fn reconcile_finals<'a>(
        &mut self,
        record: impl Fn(&VolumeKey) -> Option<(&'a str, u64, bool)>,
    ) -> Vec<VolumeKey> {
        let mut gone = Vec::new();
        let mut cleared = Vec::new();
        for (k, (id, _, at)) in &self.finals {
            match record(k) {
                None => gone.push(k.clone()),
                Some((rid, _, _)) if rid != id => gone.push(k.clone()),
                Some((_, index, false)) if at.is_some_and(|i| index >= i) => {
                    cleared.push(k.clone())
                }
                Some(_) => {}
            }
        }
        for k in &gone {
            self.finals.remove(k);
        }
        for k in &cleared {
            self.repaired(k);
        }
        cleared
    }

    /// An operator cleared the volume's "final" failure (`volume update -repaired`): this
    /// node offers it again (its own cool-down of it ends too).
    pub(crate) fn repaired(&mut self, volume: &VolumeKey) {
        self.note(
            volume,
            "offered-again",
            "an operator cleared its \"final\" failure",
        );
        self.cooling.remove(volume);
        self.transient.remove(volume);
        self.finals.remove(volume);
    }

    /// The "final" failures seen here not yet written into their records (for the status).
    pub(crate) fn pending_marks(&self) -> impl Iterator<Item = &VolumeKey> {
        self.finals
            .iter()
            .filter(|(_, (_, _, at))| at.is_none())
            .map(|(k, _)| k)
    }

    /// Whether this node leaves the create of the pending `volume` to the nodes that match a
    /// preferred topology for now: true for [`PREFER_GRACE`] after it first saw the volume
    /// pending, when `preferred` is false (it matches none).
    pub(crate) fn defers_create(
        &mut self,
        volume: &VolumeKey,
        preferred: bool,
        now: Instant,
    ) -> bool {
        if preferred {
            return false;
        }
        let seen = *self.unpreferred.entry(volume.clone()).or_insert(now);
        now.saturating_duration_since(seen) < PREFER_GRACE
    }

    /// True when the topology grace of a volume seen pending ([`PREFER_GRACE`]) ended in
    /// `(after, now]`: its create is no longer deferred here.
    pub(crate) fn grace_ended(&self, after: Instant, now: Instant) -> bool {
        self.unpreferred.values().any(|seen| {
            let end = *seen + PREFER_GRACE;
            end > after && end <= now
        })
    }

    /// Forgets the first sightings of volumes no longer pending.
    pub(crate) fn keep_unpreferred(&mut self, pending: &BTreeSet<VolumeKey>) {
        self.unpreferred.retain(|k, _| pending.contains(k));
    }

    /// Records an offer event of `volume` now.
    pub(crate) fn note(&mut self, volume: &VolumeKey, event: &'static str, detail: &str) {
        let e = OfferEvent {
            time: crate::cluster::nodes::now_unix(),
            event,
            detail: detail.chars().take(EVENT_DETAIL_CHARS).collect(),
        };
        let list = self.events.entry(volume.clone()).or_default();
        list.push_back(e);
        while list.len() > EVENTS_PER_VOLUME {
            list.pop_front();
        }
        while self.events.len() > EVENT_VOLUMES {
            let oldest = self
                .events
                .iter()
                .min_by_key(|(_, l)| l.back().map_or(0, |e| e.time))
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.events.remove(&k),
                None => break,
            };
        }
    }

    /// The recent offer events, per volume, oldest first.
    pub(crate) fn events(&self) -> &BTreeMap<VolumeKey, VecDeque<OfferEvent>> {
        &self.events
    }

    /// A publish of `volume` succeeded: its failures are forgotten.
    pub(crate) fn published(&mut self, volume: &VolumeKey) {
        self.transient.remove(volume);
        self.cooling.remove(volume);
    }

    /// Forgets cool-downs that ended; true when one did (the placeholders are due again).
    pub(crate) fn expire(&mut self, now: Instant) -> bool {
        let ended: Vec<VolumeKey> = self
            .cooling
            .iter()
            .filter(|(_, (until, _, _))| *until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &ended {
            self.cooling.remove(k);
            self.note(k, "offered-again", "its cool-down ended");
        }
        !ended.is_empty()
    }

    /// When the next cool-down ends.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.cooling.values().map(|(t, _, _)| *t).min()
    }

    /// The volumes cooling down here, with until when and why.
    pub(crate) fn cooling(&self) -> impl Iterator<Item = (&VolumeKey, &(Instant, String, bool))> {
        self.cooling.iter()
    }

    /// Why `volume` of `plugin` is withheld here at `now`, if it is. `published_here` is
    /// true when it is published on this node (never withheld then); `published` counts the
    /// plugin's volumes published here; `max` is the plugin's limit.
    pub(crate) fn withheld(
        &self,
        volume: &VolumeKey,
        plugin: &str,
        published_here: bool,
        published: usize,
        max: Option<u32>,
        now: Instant,
    ) -> Option<Withheld> {
        if published_here {
            return None;
        }
        if let Some((until, error, retried)) = self.cooling.get(volume).filter(|(t, _, _)| *t > now)
        {
            return Some(Withheld::CoolingDown {
                until: *until,
                error: error.clone(),
                retried: *retried,
            });
        }
        match max {
            Some(max) if published >= max as usize => Some(Withheld::AttachLimit {
                plugin: plugin.to_string(),
                published,
                max,
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: n.into(),
        }
    }

    /// The end of a topology grace is seen once, in the window that holds it.
    #[test]
    fn a_grace_ends_once() {
        let t0 = Instant::now();
        let mut o = Offers::default();
        assert!(o.defers_create(&key("v"), false, t0));
        let end = t0 + PREFER_GRACE;
        assert!(!o.grace_ended(t0, end - Duration::from_millis(1)));
        assert!(o.grace_ended(t0, end));
        assert!(!o.grace_ended(end, end + Duration::from_secs(5)));
        assert!(!o.defers_create(&key("v"), false, end));
    }

    /// The declared class wins over the exit code.
    #[test]
    fn a_declared_class_wins_over_the_exit_code() {
        let failed = |status: &str, class| PluginError::Failed {
            plugin: "p".into(),
            op: crate::storage::plugin::Operation::Publish,
            status: status.into(),
            message: String::new(),
            stderr: String::new(),
            class,
        };
        assert_eq!(
            class_of(&failed("exit code 69", None)),
            ErrorClass::Elsewhere
        );
        assert_eq!(
            class_of(&failed("exit code 1", None)),
            ErrorClass::RetryHere
        );
        assert_eq!(
            class_of(&failed("exit code 1", Some(ErrorClass::Final))),
            ErrorClass::Final
        );
    }

    /// A plugin at its limit withholds its other volumes, never one published here, and
    /// offers them again once one is unpublished.
    #[test]
    fn an_attach_limit_withholds_only_unpublished_volumes() {
        let t = Instant::now();
        let o = Offers::default();
        assert!(o.withheld(&key("a"), "bind", true, 1, Some(1), t).is_none());
        assert!(matches!(
            o.withheld(&key("b"), "bind", false, 1, Some(1), t),
            Some(Withheld::AttachLimit {
                published: 1,
                max: 1,
                ..
            })
        ));
        assert!(o
            .withheld(&key("b"), "bind", false, 0, Some(1), t)
            .is_none());
        assert!(o.withheld(&key("b"), "bind", false, 5, None, t).is_none());
    }

    /// "elsewhere" cools the volume down at once; transient failures only at the
    /// [`TRANSIENT_LIMIT`]th in a row (a success in between starts the count again); the
    /// cool-down ends after [`COOL_DOWN`].
    #[test]
    fn elsewhere_or_repeated_transient_failures_cool_a_volume_down() {
        let t = Instant::now();
        let mut o = Offers::default();
        assert!(o.publish_failed(&key("a"), ErrorClass::Elsewhere, "no route", t));
        let w = o.withheld(&key("a"), "bind", false, 0, None, t).unwrap();
        assert!(w.reason(t).contains("no route"), "{}", w.reason(t));
        for i in 1..TRANSIENT_LIMIT {
            assert!(
                !o.publish_failed(&key("b"), ErrorClass::RetryHere, "busy", t),
                "{i}"
            );
        }
        o.published(&key("b"));
        assert!(!o.publish_failed(&key("b"), ErrorClass::RetryHere, "busy", t));
        for _ in 1..TRANSIENT_LIMIT {
            o.publish_failed(&key("b"), ErrorClass::RetryHere, "busy", t);
        }
        assert!(o.withheld(&key("b"), "bind", false, 0, None, t).is_some());
        assert_eq!(o.next_wakeup(), Some(t + COOL_DOWN));
        assert!(!o.expire(t + COOL_DOWN / 2));
        assert!(o.expire(t + COOL_DOWN));
        assert!(o
            .withheld(&key("a"), "bind", false, 0, None, t + COOL_DOWN)
            .is_none());
    }

    /// A "final" failure seen here stays until the record, at or after the index that held
    /// it, holds none (an operator cleared it, even if no catalogue showed it set); it is
    /// forgotten when the record is gone or is another volume.
    #[test]
    fn a_final_failure_seen_here_ends_when_the_record_is_cleared() {
        let mut o = Offers::default();
        let f = FinalFailure::new("n1", "node-1", "corrupt");
        o.final_failed(&key("a"), "id-a", f.clone());
        assert_eq!(o.marks_due(|_| true).len(), 1);
        assert!(o.marks_due(|_| true).is_empty(), "one write in flight");
        o.marked(&key("a"), Some(5));
        assert!(o.pending_marks().next().is_none());
        // The catalogue still holds the record from before the mark: not cleared.
        assert!(o.reconcile_finals(|_| Some(("id-a", 4, false))).is_empty());
        assert!(o.reconcile_finals(|_| Some(("id-a", 5, true))).is_empty());
        assert!(o.final_seen(&key("a"), "id-a").is_some());
        assert_eq!(
            o.reconcile_finals(|_| Some(("id-a", 7, false))),
            vec![key("a")]
        );
        assert!(o.final_seen(&key("a"), "id-a").is_none());
        o.final_failed(&key("b"), "id-b", f);
        assert!(o
            .reconcile_finals(|_| Some(("id-other", 9, false)))
            .is_empty());
        assert!(
            o.final_seen(&key("b"), "id-b").is_none(),
            "another volume now"
        );
    }
}
