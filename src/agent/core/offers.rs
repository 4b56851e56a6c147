//! The core's side of [`crate::agent::offer`]: the attach limit of each plugin (the agent's
//! `--max-volumes` over the fingerprint's `max_volumes`), what its volumes count here, and
//! the volumes withheld from this node's waiting callers.

use super::*;
use crate::agent::offer::Withheld;
use crate::agent::retry::{Work, STEP_RETRY};
use crate::agent::view::requests;
use crate::storage::error_class::ErrorClass;
use crate::volume::final_failure::FinalFailure;

impl Core {
    /// The attach limit of `plugin` on this node: the agent's override, else the plugin's
    /// fingerprint; `None` when unlimited.
    pub(super) fn max_volumes(&self, plugin: &str) -> Option<u32> {
        self.s.max_volumes.get(plugin).copied().or_else(|| {
            self.plugins
                .get(plugin)
                .and_then(|f| f.as_ref().ok())
                .and_then(|f| f.max_volumes)
        })
    }

    /// How many volumes of each plugin have a mount record here (published, being
    /// published or unpublished, or a publish that failed and is not cleaned up yet: the
    /// storage may hold an attachment for each).
    /// Empty (no pass over the mounts) when no plugin has a limit here, as on most nodes.
    pub(super) fn attached_by_plugin(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        if !self.any_limit() {
            return out;
        }
        for m in self.journal.mounts().values() {
            *out.entry(m.plugin_id.clone()).or_insert(0) += 1;
        }
        out
    }

    /// True when a plugin has an attach limit on this node.
    fn any_limit(&self) -> bool {
        !self.s.max_volumes.is_empty()
            || self
                .plugins
                .values()
                .any(|f| f.as_ref().is_ok_and(|f| f.max_volumes.is_some()))
    }

    /// Why `rec` is withheld on this node at `now`, if it is; `attached` is
    /// [`Core::attached_by_plugin`]. A volume published here (or being unpublished) never is.
    pub(super) fn withheld(
        &self,
        rec: &VolumeRecord,
        attached: &BTreeMap<String, usize>,
        now: Instant,
    ) -> Option<Withheld> {
        let key = rec.key();
        let own = self.journal.mounts().get(&key);
        let published_here = own.is_some_and(|m| m.state != MountState::Publishing);
        if published_here {
            return None;
        }
        if let Some(f) = rec
            .final_failure
            .as_ref()
            .or_else(|| self.offers.final_seen(&key, &rec.id))
        {
            return Some(Withheld::Final(f.clone()));
        }
        if !rec.spec.availability.is_active() {
            return Some(Withheld::Unavailable(rec.spec.availability));
        }
        if !rec.spec.constraints.is_empty() {
            match &self.node_facts {
                None => return Some(Withheld::NodeUnread),
                Some(n) => {
                    if let Some(c) =
                        crate::volume::constraint::unsatisfied(n, &rec.spec.constraints)
                    {
                        return Some(Withheld::Constraint(c.to_string()));
                    }
                }
            }
        }
        if let Some(w) = self.topology_mismatch(rec) {
            return Some(w);
        }
        let plugin = &rec.spec.plugin_id;
        let others = attached
            .get(plugin)
            .copied()
            .unwrap_or(0)
            .saturating_sub(usize::from(own.is_some()));
        self.offers.withheld(
            &key,
            plugin,
            published_here,
            others,
            self.max_volumes(plugin),
            now,
        )
    }

    /// The topology `rec`'s plugin reports on this node (`None` before a good fingerprint).
    fn plugin_topology(&self, rec: &VolumeRecord) -> Option<&crate::volume::topology::Segments> {
        self.plugins
            .get(&rec.spec.plugin_id)
            .and_then(|f| f.as_ref().ok())
            .map(|f| &f.topology)
    }

    /// Why this node may not offer (nor create) `rec`: its plugin's topology here matches
    /// none of the volume's required topologies.
    pub(super) fn topology_mismatch(&self, rec: &VolumeRecord) -> Option<Withheld> {
        let req = &rec.spec.topology_request;
        let here = self.plugin_topology(rec);
        (!req.allows(here)).then(|| Withheld::Topology {
            here: here.map_or("none".into(), crate::volume::topology::show),
            required: req.show_required(),
        })
    }

    /// The pending volumes this node does not create (now): its plugin's topology here
    /// matches none of the required ones, or none of the preferred ones while the nodes
    /// that match one get [`crate::agent::offer::PREFER_GRACE`] to take it first.
    pub(super) fn creates_elsewhere(&mut self, now: Instant) -> BTreeSet<VolumeKey> {
        let mut out = BTreeSet::new();
        let mut pending = BTreeSet::new();
        for r in self.volumes.values() {
            if r.state != VolumeState::Pending || r.spec.topology_request.is_empty() {
                continue;
            }
            pending.insert(r.key());
            let preferred = r.spec.topology_request.prefers(self.plugin_topology(r));
            if self.topology_mismatch(r).is_some()
                || self.offers.defers_create(&r.key(), preferred, now)
            {
                out.insert(r.key());
            }
        }
        self.offers.keep_unpreferred(&pending);
        out
    }

    /// Why `alloc_id` may not become a new user of `rec` here (an operator paused or
    /// drained it), even where it is published: its current users keep it.
    pub(super) fn not_a_new_user(&self, rec: &VolumeRecord, alloc_id: &str) -> Option<Withheld> {
        if rec.spec.availability.is_active() {
            return None;
        }
        let user = crate::node::journal::UserKey {
            alloc_id: alloc_id.into(),
            volume: rec.key(),
        };
        (!self.journal.users().contains(&user))
            .then_some(Withheld::Unavailable(rec.spec.availability))
    }

    /// The volumes the waiting callers need that are withheld here, with why: they are
    /// refused at once (the job is to go elsewhere), not left to wait out their deadline.
    pub(super) fn refused_for_waiters(&self, now: Instant) -> BTreeMap<VolumeKey, String> {
        let mut out = BTreeMap::new();
        if self.waiters.len() == 0 {
            return out;
        }
        let attached = self.attached_by_plugin();
        for alloc_id in self.waiters.allocs() {
            let Some(alloc) = self.view.allocs().get(alloc_id.as_str()) else {
                continue;
            };
            for r in requests(alloc, &self.volumes) {
                let Some(rec) = self.volumes.get(&r.volume) else {
                    continue;
                };
                if let Some(w) = self.not_a_new_user(rec, alloc_id) {
                    out.insert(r.volume.clone(), w.reason(now));
                    continue;
                }
                if let Some(w) = self.withheld(rec, &attached, now) {
                    out.insert(r.volume.clone(), w.reason(now));
                }
            }
        }
        out
    }

    /// A publish of `volume` failed with `e`: the volume cools down here when the failure
    /// says so ([`crate::agent::offer::Offers::publish_failed`]); then its placeholder is
    /// withdrawn at the next chores.
    pub(super) fn publish_failed_here(
        &mut self,
        volume: &VolumeKey,
        e: &crate::agent::executor::StepError,
        now: Instant,
    ) {
        let class = match e {
            crate::agent::executor::StepError::Plugin(p) => crate::agent::offer::class_of(p),
            _ => ErrorClass::RetryHere,
        };
        if class == ErrorClass::Final {
            if let Some(rec) = self.volumes.get(volume) {
                let name = self.node_facts.as_ref().map_or("", |n| n.name.as_str());
                let f = FinalFailure::new(&self.s.node.node_id, name, &e.report());
                tracing::warn!(%volume, error = %f.error, "publish failed with the class \"final\": the volume is marked broken in its record, and no node offers it until an operator runs `dhv-binder volume update -repaired`");
                self.offers.final_failed(volume, &rec.id, f);
            }
        }
        if self.offers.publish_failed(volume, class, &e.report(), now) {
            tracing::warn!(%volume, %class, "publish cannot succeed on this node: its placeholder is withdrawn for a cool-down and waiting allocations are failed so that Nomad places them elsewhere");
            self.chores_due = true;
        }
    }

    /// Writes the "final" failures seen here into their records, each after its backoff.
    pub(super) fn write_final_marks(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let retries = &self.retries;
        for (volume, volume_id, failure) in self
            .offers
            .marks_due(|k| retries.ready(&Work::FinalMark(k.clone()), now))
        {
            out.push(Effect::MarkFinal {
                volume,
                volume_id,
                failure,
            });
        }
    }

    /// A mark's write finished; a failed one is tried again after a backoff.
    pub(super) fn on_final_marked(
        &mut self,
        volume: VolumeKey,
        result: Result<Option<u64>, String>,
        now: Instant,
    ) {
        let work = Work::FinalMark(volume.clone());
        match result {
            Ok(at) => {
                self.retries.succeeded(&work);
                self.offers.marked(&volume, at);
                if at.is_none() {
                    // No record of that volume any more: nothing to withhold.
                    self.offers.forget_final(&volume);
                    self.chores_due = true;
                }
            }
            Err(e) => {
                let at = self.retries.failed(&work, STEP_RETRY, now);
                self.offers.marked(&volume, None);
                tracing::warn!(%volume, error = %e, retry_in = ?at.saturating_duration_since(now), "cannot write the volume's \"final\" publish failure into its record; this node withholds it meanwhile, other nodes still offer it; retrying after a backoff");
            }
        }
    }

    /// The records in `next` whose "final" failure an operator cleared since `self.volumes`:
    /// this node forgets its own cool-down of them (offered again at once).
    /// Also notes, on a node where the volume is published, an operator's change of its
    /// availability (an event of `volume status -verbose`).
    pub(super) fn note_repairs(&mut self, next: &Catalogue) {
        for (k, old) in &self.volumes {
            let changed = next
                .get(k)
                .filter(|r| r.id == old.id && r.spec.availability != old.spec.availability);
            if let Some(r) = changed.filter(|_| self.journal.mounts().contains_key(k)) {
                let what = match r.spec.availability {
                    crate::volume::availability::Availability::Active => {
                        "active: offered to new allocations again"
                    }
                    crate::volume::availability::Availability::Pause => {
                        "pause: its users here keep it, no new allocation gets it"
                    }
                    crate::volume::availability::Availability::Drain => {
                        "drain: unpublished here once its users end"
                    }
                };
                self.offers.note(k, "availability", what);
            }
            let cleared = old.final_failure.is_some()
                && next
                    .get(k)
                    .is_some_and(|r| r.final_failure.is_none() && r.id == old.id);
            if cleared {
                tracing::info!(volume = %k, "the volume's \"final\" publish failure was cleared by an operator: offered again");
                self.offers.repaired(k);
                self.chores_due = true;
            }
        }
        let cleared = self.offers.reconcile_finals(|k| {
            next.get(k)
                .map(|r| (r.id.as_str(), r.modify_index, r.final_failure.is_some()))
        });
        for k in cleared {
            tracing::info!(volume = %k, "the volume's \"final\" publish failure seen here was cleared by an operator: offered again");
            self.chores_due = true;
        }
    }

    /// Adds this node's offer events (cool-downs, "final" failures, offered again) to the
    /// journal's events of `history`, in time order.
    pub(super) fn add_offer_events(
        &self,
        history: &mut BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>>,
    ) {
        for (k, events) in self.offers.events() {
            let list = history.entry(k.to_string()).or_default();
            list.extend(events.iter().map(|e| crate::cluster::nodes::NodeEvent {
                time: e.time,
                event: e.event.to_string(),
                // A cool-down and a "final" failure are failures; an offer again and an
                // operator's availability change are not.
                ok: !matches!(e.event, "cool-down" | "final"),
                detail: e.detail.clone(),
                ..Default::default()
            }));
            list.sort_by_key(|e| e.time);
        }
    }

    /// Reads this node's attributes at start and every
    /// [`crate::agent::offer::NODE_REREAD`], one read at a time.
    pub(super) fn read_node_if_due(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let due = self
            .node_read_at
            .is_none_or(|t| now.saturating_duration_since(t) >= crate::agent::offer::NODE_REREAD);
        if due && !self.reading_node {
            self.reading_node = true;
            self.node_read_at = Some(now);
            out.push(Effect::ReadNode);
        }
    }

    /// This node's attributes were read: a change makes the placeholders due again (a node
    /// whose attributes no longer satisfy a volume's constraints withdraws its placeholder).
    /// A failed read keeps what was known (constrained volumes stay withheld until a first
    /// read succeeds) and is tried again at the next re-read.
    pub(super) fn on_node_read(
        &mut self,
        result: Result<Option<crate::volume::constraint::NodeFacts>, crate::nomad::NomadError>,
        now: Instant,
    ) {
        self.reading_node = false;
        match result {
            Ok(Some(facts)) => {
                if self.node_facts.as_ref() != Some(&facts) {
                    tracing::info!(name = %facts.name, class = %facts.class, datacenter = %facts.datacenter, "this node's attributes read (volume constraints are evaluated against them)");
                    self.node_facts = Some(facts);
                    self.chores_due = true;
                    self.replan_all = true;
                }
            }
            Ok(None) => {
                tracing::warn!(
                    "Nomad does not know this node: volumes with constraints are not offered here"
                );
            }
            Err(e) => {
                // Sooner than a full re-read period while nothing is known.
                if self.node_facts.is_none() {
                    self.node_read_at = now
                        .checked_sub(crate::agent::offer::NODE_REREAD / 2)
                        .or(Some(now));
                }
                tracing::warn!(error = %e, "cannot read this node's attributes; volumes with constraints keep their last decision");
            }
        }
    }

    /// The attach count of each plugin with a limit on this node (the node record's
    /// `attach`, for `node status`).
    pub(crate) fn attach_counts(&self) -> BTreeMap<String, crate::cluster::nodes::AttachCount> {
        let attached = self.attached_by_plugin();
        self.plugins
            .keys()
            .filter_map(|p| {
                let max = self.max_volumes(p)?;
                Some((
                    p.clone(),
                    crate::cluster::nodes::AttachCount {
                        attached: attached.get(p).copied().unwrap_or(0) as u64,
                        max_volumes: max,
                    },
                ))
            })
            .collect()
    }

    /// The attach count and limit of each plugin, and the volumes cooling down here (the
    /// status document's `offers`).
    pub(super) fn offers_status(&self, now: Instant) -> serde_json::Value {
        let attached = self.attached_by_plugin();
        let limits: BTreeMap<&String, serde_json::Value> = self
            .plugins
            .keys()
            .map(|p| {
                (
                    p,
                    serde_json::json!({
                        "attached": attached.get(p).copied().unwrap_or(0),
                        "max_volumes": self.max_volumes(p),
                    }),
                )
            })
            .collect();
        let cooling: BTreeMap<String, serde_json::Value> = self
            .offers
            .cooling()
            .filter(|(_, (until, _, _))| *until > now)
            .map(|(k, (until, error, _))| {
                (
                    k.to_string(),
                    serde_json::json!({
                        "seconds_left": until.saturating_duration_since(now).as_secs(),
                        "error": error,
                    }),
                )
            })
            .collect();
        let constrained: BTreeMap<String, String> = self
            .volumes
            .values()
            .filter(|r| !r.spec.constraints.is_empty())
            .map(|r| {
                let why = match &self.node_facts {
                    None => Withheld::NodeUnread.reason(now),
                    Some(n) => match crate::volume::constraint::unsatisfied(n, &r.spec.constraints)
                    {
                        Some(c) => Withheld::Constraint(c.to_string()).reason(now),
                        None => "offered: this node satisfies every constraint".to_string(),
                    },
                };
                (r.key().to_string(), why)
            })
            .collect();
        let topology: BTreeMap<String, String> = self
            .volumes
            .values()
            .filter(|r| !r.spec.topology_request.required.is_empty())
            .map(|r| {
                let why = match self.topology_mismatch(r) {
                    Some(w) => w.reason(now),
                    None => "offered: the plugin's topology here matches a required one".into(),
                };
                (r.key().to_string(), why)
            })
            .collect();
        let marks: Vec<String> = self.offers.pending_marks().map(|k| k.to_string()).collect();
        serde_json::json!({"plugins": limits, "cooling_down": cooling, "constraints": constrained, "topology": topology, "final_marks_pending": marks})
    }
}
