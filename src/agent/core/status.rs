//! What the core reports: the `status` document of the local API and the counts the
//! shell's metrics read after a pass.

use super::*;

impl Core {
    /// The status document (`GET /v1/status`): snake_case field names, times as Unix seconds
    /// in fields named `since` or `*_since` (the CLI's `-json` converts both by that rule:
    /// `crate::cli::output::nomad_json`; a new map keyed by plain words such as plugin IDs
    /// needs a line in `crate::cli::status::SHAPE`).
    pub(super) fn status(&self) -> serde_json::Value {
        let deferred = self.deferred_plugins();
        let volumes: Vec<_> = self
            .volumes
            .values()
            .map(|r| {
                serde_json::json!({
                    "namespace": r.spec.namespace, "name": r.spec.name, "id": r.id,
                    "plugin_id": r.spec.plugin_id, "state": r.state.as_str(),
                    "served_here": self.serves(r, &deferred),
                    "placeholder_id": self.placeholders.id(&r.key()),
                })
            })
            .collect();
        let plugins: BTreeMap<_, _> = self
            .plugins
            .iter()
            .map(|(id, r)| match r {
                Ok(fp) => (
                    id.clone(),
                    serde_json::json!({"version": fp.version, "deferred_bind": fp.deferred_bind}),
                ),
                Err(e) => (id.clone(), serde_json::json!({"error": e})),
            })
            .collect();
        serde_json::json!({
            "node_id": self.s.node.node_id,
            "node_pool": self.s.node.node_pool,
            "watch": self.watch,
            "view": {"complete": self.view.is_complete(), "index": self.view.index(), "allocations": self.view.allocs().len(), "departing": self.view.departing()},
            "volumes": volumes,
            "mounts": self.journal.mounts().values().map(|m| &**m).collect::<Vec<_>>(),
            "users": self.journal.users(),
            "waiting": self.waiting.iter().map(|w| serde_json::json!({"volume": w.volume.to_string(), "reason": w.reason})).collect::<Vec<_>>(),
            "errors": self.last_error.iter().map(|(k, e)| (k.to_string(), e.clone())).collect::<BTreeMap<_, _>>(),
            "plugins": plugins,
            "publish_latency_ms": {"count": self.latency.count(), "median": self.latency.median_bound(), "last": self.latency.last()},
            "pending_publish_calls": self.waiters.len(),
            "claims": self.claims.status(),
            "fenced": self.fenced.iter().map(|(k, f)| (k.to_string(), f.clone())).collect::<BTreeMap<_, _>>(),
            "mount_health": self.mount_health.status(),
            "refresh": self.refreshes.status(),
            "storage_ops": {"snapshots": self.storage_ops.snapshot_count(), "running": self.storage_ops.running()},
            "frozen": self.storage_ops.frozen().iter().map(|(k, f)| (k.to_string(), f)).collect::<BTreeMap<_, _>>(),
            "foreign_mounts": self.foreign.iter().map(|(k, why)| (k.to_string(), why.clone())).collect::<BTreeMap<_, _>>(),
            "holders": self.holders.iter().map(|(k, u)| (k.to_string(), u)).collect::<BTreeMap<_, _>>(),
            "unfenced": self.unfenced,
            "journal": self.journal_trouble.status(),
            "offers": self.offers_status(self.now),
            "ungated": self.ungated.iter().map(|(id, u)| (id.clone(), u)).collect::<BTreeMap<_, _>>(),
            // Ungated tasks whose allocation ended before their volume was published here.
            "ungated_exited": self.ungated_exited.iter().map(|(id, u)| serde_json::json!({"alloc_id": id, "task": u})).collect::<Vec<_>>(),
        })
    }
}

/// Counts the shell's metrics read after a pass (agent/meter.rs).
impl Core {
    /// Allocations of this node and volume records known (O(1)).
    pub(crate) fn known(&self) -> (usize, usize) {
        (self.view.allocs().len(), self.volumes.len())
    }

    /// Volume records this node serves (a pass over the catalogue: ask when it or the
    /// plugins changed).
    pub(crate) fn volumes_served(&self) -> usize {
        let deferred = self.deferred_plugins();
        self.volumes
            .values()
            .filter(|r| self.serves(r, &deferred))
            .count()
    }

    /// This node's claims: `[held, fenced, lost, waiting]`, and the claims' version (count
    /// again only when it moved, see `Claims::version`).
    pub(crate) fn claims_by_state(&self) -> ([usize; 4], u64) {
        (self.claims.counts(), self.claims.version())
    }

    /// Claim waits begun since the start, current ones, and when the oldest began.
    pub(crate) fn claim_waits(&self) -> (u64, usize, Option<Instant>) {
        let w = &self.claim_waits;
        (w.begun(), w.current(), w.oldest())
    }

    /// The claims' version alone (O(1)).
    pub(crate) fn claims_version(&self) -> u64 {
        self.claims.version()
    }

    /// The targets the mount table shows mounted (the usage task reads only those).
    pub(crate) fn mounted(&self) -> &BTreeSet<PathBuf> {
        &self.mounted
    }

    /// Volumes a freezing operation may hold frozen (O(1)).
    pub(crate) fn frozen_count(&self) -> usize {
        self.storage_ops.frozen().len()
    }

    /// Mount records by state: publishing, published, unpublishing (a pass over the
    /// records: ask after a pass that commits, which writes them all anyway).
    pub(crate) fn mounts_by_state(&self) -> [usize; 3] {
        let mut n = [0; 3];
        for m in self.journal.mounts().values() {
            n[match m.state {
                MountState::Publishing => 0,
                MountState::Published => 1,
                MountState::Unpublishing => 2,
            }] += 1;
        }
        n
    }
}
