//! The core's side of [`crate::agent::offer`]: the attach limit of each plugin (the agent's
//! `--max-volumes` over the fingerprint's `max_volumes`), what its volumes count here, and
//! the volumes withheld from this node's waiting callers.

use super::*;
use crate::agent::offer::Withheld;
use crate::agent::view::requests;
use crate::storage::error_class::ErrorClass;

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
    pub(super) fn attached_by_plugin(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for m in self.journal.mounts().values() {
            *out.entry(m.plugin_id.clone()).or_insert(0) += 1;
        }
        out
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

    /// The volumes the waiting callers need that are withheld here, with why: they are
    /// refused at once (the job is to go elsewhere), not left to wait out their deadline.
    pub(super) fn refused_for_waiters(&self, now: Instant) -> BTreeMap<VolumeKey, String> {
        let attached = self.attached_by_plugin();
        let mut out = BTreeMap::new();
        for alloc_id in self.waiters.allocs() {
            let Some(alloc) = self.view.allocs().get(alloc_id) else {
                continue;
            };
            for r in requests(alloc, &self.volumes) {
                let Some(rec) = self.volumes.get(&r.volume) else {
                    continue;
                };
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
            crate::agent::executor::StepError::Plugin(p) => ErrorClass::of(p),
            _ => ErrorClass::RetryHere,
        };
        if self.offers.publish_failed(volume, class, &e.report(), now) {
            tracing::warn!(%volume, %class, "publish cannot succeed on this node: its placeholder is withdrawn for a cool-down and waiting allocations are failed so that Nomad places them elsewhere");
            self.chores_due = true;
        }
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
            .filter(|(_, (until, _))| *until > now)
            .map(|(k, (until, error))| {
                (
                    k.to_string(),
                    serde_json::json!({
                        "seconds_left": until.saturating_duration_since(now).as_secs(),
                        "error": error,
                    }),
                )
            })
            .collect();
        serde_json::json!({"plugins": limits, "cooling_down": cooling})
    }
}
