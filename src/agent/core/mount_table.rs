//! What the host's mount table says about this node's targets: the core reads it on the
//! tick, checks each published target against it (the kernel, not the records, decides
//! whether a volume is mounted) and releases the gate of allocations waiting on it.

use super::*;

impl Core {
    /// Takes a new reading of the host's mount table and checks against it the targets it
    /// can have changed: where the table differs from the last reading
    /// ([`MountTable::changed_points`]) and where a mount record changed since the last
    /// check. The first reading checks every record. O(mounts) integer work per reading plus
    /// O(log n) per changed target: a burst of N publishes no longer costs N passes over
    /// every record (issue 10).
    pub(super) fn on_table(&mut self, t: MountTable) {
        let before = std::mem::replace(&mut self.table, t);
        if !self.targets_checked || !self.scoped {
            self.targets_checked = true;
            self.journal.take_touched();
            self.check_all_targets();
            return;
        }
        let mut paths: BTreeSet<(PathBuf, Option<VolumeKey>)> = self
            .table
            .changed_points(&before)
            .into_iter()
            .map(|p| (p, None))
            .collect();
        paths.extend(
            self.journal
                .take_touched()
                .into_iter()
                .map(|(p, k)| (p, Some(k))),
        );
        for (p, k) in paths {
            self.check_target(&p, k.as_ref());
        }
    }

    /// Checks the targets whose mount records changed since the last check against the
    /// current reading (after a publish established what "published" means).
    pub(super) fn check_touched(&mut self) {
        if !self.targets_checked {
            return;
        }
        for (p, k) in self.journal.take_touched() {
            self.check_target(&p, Some(&k));
        }
    }

    /// Every record against the current reading (the first reading).
    pub(super) fn check_all_targets(&mut self) {
        let records: Vec<(PathBuf, VolumeKey)> = self
            .journal
            .mounts()
            .iter()
            .map(|(k, m)| (m.target.clone(), k.clone()))
            .collect();
        let stale_points: Vec<PathBuf> = self
            .mounted
            .iter()
            .filter(|p| self.journal.volume_at(p).is_none())
            .cloned()
            .collect();
        let stale_keys: Vec<VolumeKey> = self
            .foreign
            .keys()
            .filter(|k| !self.journal.mounts().contains_key(*k))
            .cloned()
            .collect();
        for (p, k) in records {
            self.check_target(&p, Some(&k));
        }
        for p in stale_points {
            self.check_target(&p, None);
        }
        for k in stale_keys {
            self.clear_foreign(&k);
        }
    }

    /// What the current reading says of the record (if any) targeting `target`; `gone` is
    /// a volume whose record was removed or moved away from `target`.
    pub(super) fn check_target(&mut self, target: &std::path::Path, gone: Option<&VolumeKey>) {
        use crate::node::mounts::TargetState;
        self.plan_visits += 1;
        // A volume whose record went (or moved away from `target`) is nobody's foreign
        // mount any more.
        if let Some(k) = gone {
            if !self.journal.mounts().contains_key(k) {
                self.clear_foreign(k);
            }
        }
        let Some(key) = self.journal.volume_at(target).cloned() else {
            // No record targets it (any more): it is nobody's "published".
            self.mounted.remove(target);
            return;
        };
        let Some(m) = self.journal.mounts().get(&key) else {
            return;
        };
        let state = self.table.target_state(&m.target, m.mount.as_ref());
        let published = matches!(state, TargetState::Published { .. });
        let found = match state {
            TargetState::Published { .. } => None,
            TargetState::Unmounted => None,
            // Nothing established yet (an interrupted publish, an older journal): the
            // plugin's idempotent publish decides whether the mount is the volume's.
            _ if m.mount.is_none() => None,
            TargetState::Foreign { found } => Some(found.to_string()),
            TargetState::Stacked { count, top } => {
                Some(format!("{count} stacked mounts ({top} on top)"))
            }
        };
        let why = found.map(|found| {
            format!(
                "{} holds {found}, not this volume's mount{}: it is not published over nor used; unmount it",
                m.target.display(),
                m.mount.as_ref().map(|i| format!(" ({i})")).unwrap_or_default()
            )
        });
        // The volumes whose answer changed are planned again.
        let changed = if published {
            self.mounted.insert(target.to_path_buf())
        } else {
            self.mounted.remove(target)
        };
        if changed {
            self.dirty.insert(key.clone());
        }
        match why {
            Some(why) => {
                if self.foreign.get(&key) != Some(&why) {
                    tracing::error!(volume = %key, reason = %why, "foreign mount at a volume's target");
                    self.dirty.insert(key.clone());
                    self.foreign.insert(key, why);
                }
            }
            None => self.clear_foreign(&key),
        }
    }

    pub(super) fn clear_foreign(&mut self, key: &VolumeKey) {
        if self.foreign.remove(key).is_some() {
            tracing::info!(volume = %key, "the foreign mount at the volume's target is gone");
            self.dirty.insert(key.clone());
        }
    }

    /// Notes (and logs once) the tasks of an allocation that could start on a deferred
    /// volume before it is published: no prestart gate.
    pub(super) fn check_gate(&mut self, alloc_id: &str) {
        let Some(a) = self.view.allocs().get(alloc_id) else {
            self.ungated.remove(alloc_id);
            self.unfenced.remove(alloc_id);
            return;
        };
        let found = if a.tasks_finished() {
            // An ungated task whose allocation ended before its volume was published here
            // never saw the volume: its work did not reach it. Said loudly (log, status,
            // `volume status`), since Nomad reports the job as it ended.
            for u in self.ungated.remove(alloc_id).unwrap_or_default() {
                let published = self.journal.mounts().get(&u.volume).is_some_and(|m| {
                    m.state == MountState::Published && self.mounted.contains(&m.target)
                });
                if published {
                    continue;
                }
                tracing::error!(%alloc_id, job = %u.job, group = %u.group, task = %u.task, volume = %u.volume, "allocation {alloc_id} ended before deferred volume {} was published on this node: its task {:?} ran on the empty read-only placeholder, and nothing it wrote reached the volume; run the job again with the prestart task (jobspecs/example.nomad.hcl)", u.volume, u.task);
                self.ungated_exited.push_back((alloc_id.to_string(), u));
                while self.ungated_exited.len() > crate::agent::gate::EXITED_KEPT {
                    self.ungated_exited.pop_front();
                }
            }
            Vec::new()
        } else {
            let reqs = crate::agent::view::requests(a, &self.volumes);
            let lease = self.s.claims.ttl + self.s.claims.lock_delay;
            let heartbeat_max = self.s.heartbeat_interval_max;
            match unfenced(alloc_id, a, &reqs, &self.volumes, lease, heartbeat_max) {
                Some(w) => {
                    if self.unfenced.get(alloc_id) != Some(&w) {
                        tracing::warn!(%alloc_id, "{w}");
                    }
                    self.unfenced.insert(alloc_id.to_string(), w);
                }
                None => {
                    self.unfenced.remove(alloc_id);
                }
            }
            crate::agent::gate::ungated(a, &reqs, crate::agent::gate::SOCKET_VOLUME)
        };
        if found.is_empty() {
            self.ungated.remove(alloc_id);
            return;
        }
        if self.ungated.get(alloc_id) != Some(&found) {
            for u in &found {
                tracing::warn!(%alloc_id, job = %u.job, group = %u.group, task = %u.task, volume = %u.volume, "{u}");
            }
        }
        self.ungated.insert(alloc_id.to_string(), found);
    }
}

/// How much longer than the client's heartbeat interval `stop_on_client_after` must be: a
/// heartbeat's round trip and a retry after one that failed (a client whose heartbeat fails
/// with its TTL passed retries after 1–2 s: `client/client.go` `getHeartbeatRetryIntv`).
pub(crate) const HEARTBEAT_SLACK: Duration = Duration::from_secs(5);

/// Why an allocation is `unfenced` (a warning, in the log and status): it writes a
/// `single-node-*` volume while its group has no `disconnect { stop_on_client_after }`
/// within `lease` (TTL + lock delay: a TTL before another node may take the claim, whose
/// lease is 2 x TTL + lock delay after the last renewal): if this node's agent
/// is frozen or gone while its client loses the servers, nothing stops its tasks before
/// another node may take the volume (docs/operations/claims.md, "Claims"). Or its group's
/// `stop_on_client_after` is not longer than the client's heartbeat interval (up to
/// `heartbeat_max`) plus [`HEARTBEAT_SLACK`]: Nomad's client counts it from its last heartbeat
/// that succeeded (`client/heartbeatstop.go` `shouldStopAfter`, `client/client.go`
/// `updateNodeStatus` → `setLastOk`), so it stops the group's healthy allocations between two
/// heartbeats.
fn unfenced(
    alloc_id: &str,
    a: &crate::nomad::types::Allocation,
    reqs: &[crate::agent::view::Request],
    volumes: &Catalogue,
    lease: Duration,
    heartbeat_max: Duration,
) -> Option<String> {
    let writes_exclusive = reqs.iter().find(|r| {
        !r.read_only
            && volumes.get(&r.volume).is_some_and(|v| {
                crate::cluster::claims::is_exclusive(v.access_mode())
                    && !v.access_mode().ends_with("reader-only")
            })
    });
    let stop = a.group().and_then(|g| g.stop_on_client_after());
    let low = heartbeat_max + HEARTBEAT_SLACK;
    let advice = if low <= lease {
        format!("set stop_on_client_after between {low:?} (--heartbeat-interval-max + {HEARTBEAT_SLACK:?}) and {lease:?} (--claim-ttl + --claim-lock-delay)")
    } else {
        format!("no stop_on_client_after is safe: the client's heartbeat interval (up to {heartbeat_max:?}, --heartbeat-interval-max) plus {HEARTBEAT_SLACK:?} exceeds {lease:?} (--claim-ttl + --claim-lock-delay); raise --claim-ttl or --claim-lock-delay until their sum is at least {low:?}, then set stop_on_client_after between the two")
    };
    match (writes_exclusive, stop) {
        (_, Some(d)) if !reqs.is_empty() && d < low => Some(format!(
            "unfenced: allocation {alloc_id} has disconnect {{ stop_on_client_after = {d:?} }}, shorter than its client's heartbeat interval (up to {heartbeat_max:?}, --heartbeat-interval-max) plus {HEARTBEAT_SLACK:?}: Nomad counts it from the last heartbeat, so it stops the group's healthy allocations between two heartbeats; {advice}"
        )),
        (None, _) => None,
        (Some(_), Some(d)) if d <= lease => None,
        (Some(r), Some(d)) => Some(format!(
            "unfenced: allocation {alloc_id} writes single-node volume {} with disconnect {{ stop_on_client_after = {d:?} }}, longer than {lease:?} (--claim-ttl + --claim-lock-delay, a TTL before another node could take the volume); if this node's dhv-binder is down while its client loses the servers, its tasks may still write when another node takes the volume: {advice}",
            r.volume
        )),
        (Some(r), None) => Some(format!(
            "unfenced: allocation {alloc_id} writes single-node volume {} and its group has no disconnect {{ stop_on_client_after }}; if this node's dhv-binder is down while its client loses the servers, nothing stops its tasks before another node takes the volume: {advice}",
            r.volume
        )),
    }
}
