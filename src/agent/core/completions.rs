//! How the core takes a finished piece of work: a journal commit that became durable (or
//! failed), and a typed completion of an effect the shell ran (plugin call, Nomad call).

use super::*;

impl Core {
    pub(super) fn on_committed(
        &mut self,
        seq: u64,
        result: Result<(), JournalError>,
        out: &mut Vec<Effect>,
    ) {
        match result {
            Ok(()) => {
                if let Some(blamed) = self.journal_trouble.succeeded(self.now) {
                    // The publishes and unpublishes that waited for it start now, and the
                    // errors it gave are over (not one another step gave since).
                    self.replan_all = true;
                    for (volume, why) in blamed {
                        if self.last_error.get(&volume) == Some(&why) {
                            self.last_error.remove(&volume);
                        }
                    }
                }
                self.durable = self.durable.max(seq);
                let durable = self.durable;
                self.gated.retain(|s, _| *s > durable);
                let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|(s, _, _)| *s <= durable);
                self.held = keep;
                for (_, to, reply) in ready {
                    out.push(Effect::Reply {
                        to,
                        answer: Answer::Publish(Ok(reply)),
                    });
                }
            }
            Err(e) => {
                // The plugin calls of this commit were not started: fail them (their
                // intents stay in memory and are written with the next commit), and
                // answer no caller from records that are not on disk.
                // Logged once when writes start failing and then at most once a minute
                // (agent/journal_trouble.rs), not once per attempt.
                self.journal_trouble.failed(&e.to_string(), self.now);
                self.journal.redo();
                let failed: Vec<u64> = self.gated.range(..=seq).map(|(s, _)| *s).collect();
                for s in failed {
                    for volume in self.gated.remove(&s).unwrap_or_default() {
                        self.busy.remove(&volume);
                        self.dirty.insert(volume.clone());
                        // Not backed off per volume: the journal's own pace holds every
                        // publish and unpublish until a write succeeds.
                        let why = format!("journal write failed: {e}");
                        self.journal_trouble.blame(&volume, &why);
                        self.last_error.insert(volume, why);
                    }
                }
                let (failed, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|(s, _, _)| *s <= seq);
                self.held = keep;
                for (_, to, _) in failed {
                    out.push(Effect::Reply {
                        to,
                        answer: Answer::Publish(Err(ApiError::Journal(e.to_string()))),
                    });
                }
            }
        }
    }

    pub(super) fn on_done(&mut self, done: Completion, now: Instant, out: &mut Vec<Effect>) {
        let unpublished = match &done {
            Completion::Unpublished { volume, result } => {
                Some((volume.clone(), result.as_ref().err().map(|e| e.report())))
            }
            _ => None,
        };
        self.on_done_inner(done, now, out);
        if let Some((volume, refused)) = unpublished {
            self.on_forced_unpublished(&volume, refused, out);
        }
    }

    fn on_done_inner(&mut self, done: Completion, now: Instant, out: &mut Vec<Effect>) {
        match &done {
            Completion::Published { volume, .. }
            | Completion::Unpublished { volume, .. }
            | Completion::ClaimAcquired { volume, .. }
            | Completion::ClaimRenewed { volume, .. }
            | Completion::ClaimReleased { volume, .. } => {
                self.dirty.insert(volume.clone());
            }
            _ => {}
        }
        // Chores (placeholders, creates and deletes) are a pass over every volume: due on
        // what can change them, not on every unpublish of a wave (that made a wave of N
        // unpublishes O(N²)). An unpublish matters to them only when its volume is no
        // longer ready (a delete waits for it) or its plugin has a limit of volumes here
        // (one fewer attached: its other placeholders come back); the tick runs them
        // anyway, at least every `CHORES_EVERY`.
        let unpublished_chore = matches!(
            &done,
            Completion::Unpublished { volume, .. }
                if !self.volumes.get(volume).is_some_and(|r| r.state == VolumeState::Ready)
                    || self
                        .journal
                        .mounts()
                        .get(volume)
                        .is_some_and(|m| self.max_volumes(&m.plugin_id).is_some())
        );
        if unpublished_chore
            || matches!(
                done,
                Completion::PlaceholdersListed(_)
                    | Completion::Placeholder { .. }
                    | Completion::Worker { .. }
            )
        {
            self.chores_due = true;
        }
        match done {
            Completion::NodeRead(result) => self.on_node_read(result, now),
            Completion::FinalMarked { volume, result } => self.on_final_marked(volume, result, now),
            Completion::Published {
                volume,
                result,
                elapsed,
            } => {
                self.busy.remove(&volume);
                let Some(mut m) = self
                    .journal
                    .mounts()
                    .get(&volume)
                    .map(|m| MountRecord::clone(m))
                else {
                    return;
                };
                match result {
                    Ok(p) => {
                        m.state = MountState::Published;
                        m.publish_context = p.context.into();
                        m.mount = Some(p.mount);
                        m.last_error.clear();
                        self.retries.succeeded(&Work::Mount(volume.clone()));
                        self.last_error.remove(&volume);
                        self.offers.published(&volume);
                        // One more attached volume: a plugin with a limit may be at it now
                        // (its other placeholders go at once, not at the next tick).
                        if self.max_volumes(&m.plugin_id).is_some() {
                            self.chores_due = true;
                        }
                        let ms = elapsed.as_millis() as u64;
                        self.latency.record(ms);
                        tracing::info!(%volume, target = %m.target.display(), ms, "published");
                        self.journal.set_mount(m, EventKind::PublishDone, None);
                        self.journal.measured(&volume, ms);
                        // Tasks that may have started on the empty placeholder get the volume
                        // by a restart (a republish after a dead mount restarts its users
                        // itself, once the mount answers).
                        if !self.mount_health.republishing(&volume) {
                            let mut all_restarted = BTreeSet::new();
                            for (alloc_id, task) in
                                crate::agent::gate::restart_on_publish(&self.ungated, &volume)
                            {
                                // A task that already exited (on the placeholder) is not
                                // running: Nomad refuses to restart it by name, so the
                                // allocation's tasks are restarted all, that one included.
                                let exited =
                                    self.view.allocs().get(alloc_id.as_str()).is_some_and(|a| {
                                        a.task_states
                                            .get(task.as_str())
                                            .is_some_and(|t| t.state == "dead")
                                    });
                                if exited && !all_restarted.insert(alloc_id.clone()) {
                                    continue;
                                }
                                tracing::info!(%volume, %alloc_id, %task, exited, "restarting an ungated task onto the published volume");
                                out.push(Effect::RestartAlloc {
                                    volume: volume.clone(),
                                    alloc_id,
                                    task: (!exited).then_some(task),
                                    all_tasks: exited,
                                });
                            }
                        }
                        // What the publish established is now what "published" means.
                        if self.scoped {
                            self.check_touched();
                        } else {
                            self.check_all_targets();
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "publish failed; will retry with backoff");
                        m.last_error = e.report();
                        self.step_failed(&volume, &e);
                        self.publish_failed_here(&volume, &e, now);
                        self.retries
                            .failed(&Work::Mount(volume.clone()), STEP_RETRY, now);
                        self.journal.set_mount(m, EventKind::PublishFailed, None);
                        self.journal.measured(&volume, elapsed.as_millis() as u64);
                    }
                }
            }
            Completion::Unpublished { volume, result } => {
                self.busy.remove(&volume);
                match result {
                    Ok(()) => {
                        self.retries.succeeded(&Work::Mount(volume.clone()));
                        self.last_error.remove(&volume);
                        self.holders.remove(&volume);
                        self.fenced.remove(&volume);
                        tracing::info!(%volume, "unpublished");
                        self.journal.remove_mount(&volume, EventKind::UnpublishDone);
                        self.claims.on_unpublished(&volume);
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "unpublish failed; will retry with backoff");
                        if let crate::agent::executor::StepError::InUse { usage, .. } = &e {
                            // Retried as soon as the processes it names exit, not only
                            // on the backoff.
                            out.push(Effect::WatchHolders {
                                volume: volume.clone(),
                                pids: usage.pids(),
                            });
                            self.holders.insert(volume.clone(), (**usage).clone());
                        }
                        self.step_failed(&volume, &e);
                        self.retries
                            .failed(&Work::Mount(volume.clone()), STEP_RETRY, now);
                        if let Some(mut m) = self
                            .journal
                            .mounts()
                            .get(&volume)
                            .map(|m| MountRecord::clone(m))
                        {
                            m.last_error = e.report();
                            self.journal.set_mount(m, EventKind::UnpublishFailed, None);
                        }
                    }
                }
            }
            Completion::Plugins(map) => {
                self.fingerprinting = false;
                let map: BTreeMap<String, Result<Fingerprint, String>> = map
                    .into_iter()
                    .map(|(id, r)| (id, r.map_err(|e| e.to_string())))
                    .collect();
                for (id, r) in &map {
                    if self.plugins.get(id) == Some(r) {
                        continue;
                    }
                    match r {
                        Ok(fp) if fp.deferred_bind => {
                            tracing::info!(plugin = %id, version = %fp.version, "plugin fingerprinted (deferred_bind)")
                        }
                        Ok(fp) => {
                            tracing::warn!(plugin = %id, version = %fp.version, "plugin is not deferred (no deferred_bind): dhv-binder will not use it")
                        }
                        Err(e) => {
                            tracing::warn!(plugin = %id, error = %e, "plugin fingerprint failed")
                        }
                    }
                }
                let before = self.deferred_plugins();
                self.plugins = map;
                if !self.plugins_loaded || self.deferred_plugins() != before {
                    self.replan_all = true;
                }
                self.plugins_loaded = true;
                self.chores_due = true;
            }
            Completion::PluginsUnreadable { dir, error } => {
                // Never "no plugins" (issue 13 §2): the plugins known before stand, and the
                // next fingerprint runs every plugin again.
                self.fingerprinting = false;
                self.fingerprint_every = true;
                tracing::warn!(plugin_dir = %dir.display(), %error, "plugin directory unreadable: keeping the plugins known before");
            }
            Completion::PlaceholdersListed(r) => {
                self.placeholders.on_listed(r, &mut self.retries, now)
            }
            Completion::Placeholder { volume, result } => {
                self.placeholders
                    .on_done(volume, result, &mut self.retries, now)
            }
            Completion::Worker { volume, result } => {
                self.workers.on_done(volume, result, &mut self.retries, now)
            }
            Completion::Storage { op, result, thawed } => {
                if let Some(v) =
                    self.storage_ops
                        .on_done(op, result, thawed, &mut self.retries, now)
                {
                    self.busy.remove(&v);
                }
            }
            Completion::ClaimAcquired { volume, result } => {
                self.busy.remove(&volume);
                if let Ok(acq) = &result {
                    // A take-over fenced other nodes; a node taking back a claim it held
                    // last (or was fenced from) only restored its own access.
                    let kind = if !acq.fence.is_empty() {
                        Some(EventKind::NodeFenced)
                    } else {
                        acq.unfence.then_some(EventKind::NodeUnfenced)
                    };
                    if let Some(kind) = kind {
                        self.journal.note(
                            kind,
                            &volume,
                            serde_json::json!({"fenced_nodes": acq.fence, "unfenced_self": acq.unfence}),
                        );
                    }
                }
                self.claims
                    .on_acquired(volume, result, &mut self.retries, now);
            }
            Completion::ClaimRenewed {
                volume,
                lock_id,
                sent,
                result,
            } => {
                let mounted_here = self.journal.mounts().contains_key(&volume);
                let renewal =
                    self.claims
                        .on_renewed(&volume, &lock_id, sent, result, mounted_here, now);
                if renewal == crate::agent::claims::Renewal::Released {
                    self.journal.note(
                        EventKind::ClaimReleased,
                        &volume,
                        serde_json::json!({"by": "operator", "mounted_here": mounted_here}),
                    );
                    if mounted_here && !self.fenced.contains_key(&volume) {
                        self.fence(
                            volume.clone(),
                            None,
                            None,
                            "an operator released this node's claim (`volume claim release`; another node may take it now)",
                            out,
                        );
                    }
                }
                // A claim lost (its lease ended: a paused or starved agent learns it from the
                // renewal's answer before its own clock's fence) is fenced at once where the
                // volume is still mounted: its writers must stop before another node takes
                // it, and an unpublish is refused while they hold the mount.
                if renewal == crate::agent::claims::Renewal::Lost
                    && mounted_here
                    && !self.fenced.contains_key(&volume)
                {
                    self.fence(
                        volume.clone(),
                        None,
                        None,
                        "this node lost its claim (its lease ended; another node may take it now)",
                        out,
                    );
                }
                // A fence still running (its report not in) may yet be withdrawn: the restore
                // waits for its report ([`Completion::Fenced`]).
                let running = self
                    .fenced
                    .get(&volume)
                    .is_some_and(|f| f["fence"].is_null());
                if renewal == crate::agent::claims::Renewal::Restored && running {
                    if let Some(f) = self.fenced.get_mut(&volume) {
                        f["renewed"] = serde_json::json!(true);
                    }
                } else if renewal == crate::agent::claims::Renewal::Restored {
                    self.fenced.remove(&volume);
                    if let Some(m) = self.journal.mounts().get(&volume) {
                        let target = m.target.clone();
                        self.journal.note(
                            EventKind::Unfenced,
                            &volume,
                            serde_json::json!({"target": target}),
                        );
                        // The fenced mount (read-only, or its FUSE connection aborted) is
                        // detached and published again; its allocations are restarted onto it.
                        out.extend(self.mount_health.restore_fenced(
                            &volume,
                            &target,
                            self.journal.users(),
                        ));
                    }
                }
            }
            Completion::Fenced { volume, report } => {
                if report.complete() {
                    tracing::warn!(%volume, target = %report.target.display(), fence = %report.summary(), "volume fenced on this node");
                } else {
                    tracing::error!(%volume, target = %report.target.display(), fence = %report.summary(), "fence incomplete: a writer may remain on this node");
                }
                if let Some(f) = self.fenced.get_mut(&volume) {
                    f["fence"] = serde_json::json!(report);
                }
                // Renewed while the fence ran: the claim is still this node's, restore now.
                if self
                    .fenced
                    .get(&volume)
                    .is_some_and(|f| f["renewed"] == true)
                {
                    self.fenced.remove(&volume);
                    if let Some(m) = self.journal.mounts().get(&volume) {
                        let target = m.target.clone();
                        self.journal.note(
                            EventKind::Unfenced,
                            &volume,
                            serde_json::json!({"target": target}),
                        );
                        out.extend(self.mount_health.restore_fenced(
                            &volume,
                            &target,
                            self.journal.users(),
                        ));
                    }
                }
            }
            Completion::FenceWithdrawn {
                volume,
                lock_id,
                sent,
            } => {
                let mounted_here = self.journal.mounts().contains_key(&volume);
                let _ = self
                    .claims
                    .on_renewed(&volume, &lock_id, sent, Ok(()), mounted_here, now);
                tracing::warn!(%volume, "fence withdrawn before it ran: a renewal that succeeded keeps the claim this node's (nothing was killed)");
                if self.fenced.remove(&volume).is_some() {
                    let target = self.journal.mounts().get(&volume).map(|m| m.target.clone());
                    self.journal.note(
                        EventKind::Unfenced,
                        &volume,
                        serde_json::json!({"target": target, "withdrawn": true}),
                    );
                }
            }
            Completion::ClaimReleased { volume, result } => {
                self.busy.remove(&volume);
                self.claims.on_released(&volume, result);
            }
            Completion::AllocFetched { alloc_id, result } => {
                self.fetching.remove(&alloc_id);
                let fail = match result {
                    Ok(Some(a)) if *a.node_id == *self.s.node.node_id => {
                        self.view.upsert(*a);
                        None
                    }
                    Ok(Some(a)) => Some(ApiError::OtherNode {
                        alloc_id: alloc_id.clone(),
                        node: a.node_id.to_string(),
                        here: self.s.node.node_id.clone(),
                    }),
                    Ok(None) => Some(ApiError::UnknownAllocation {
                        alloc_id: alloc_id.clone(),
                    }),
                    Err(e) => Some(ApiError::Nomad(e.to_string())),
                };
                if let Some(err) = fail {
                    for (to, r) in self.waiters.fail(&alloc_id, err) {
                        out.push(Effect::Reply {
                            to,
                            answer: Answer::Publish(r),
                        });
                    }
                }
            }
            Completion::Probed {
                volume,
                target,
                probe,
            } => {
                let busy = self.busy.contains(&volume);
                out.extend(self.mount_health.on_probe(
                    &volume,
                    &target,
                    probe,
                    busy,
                    self.journal.users(),
                ));
            }
            Completion::HoldersKilled { volume, report } => self.on_holders_killed(volume, report),
            Completion::HoldersExited { volume } => {
                // The evidence the unpublish waits on: retried now (the retry scans again;
                // a new holder is refused and watched as before).
                if self.holders.contains_key(&volume) {
                    tracing::info!(%volume, "the processes that held the volume exited: unpublish retried now");
                    self.retries.due_at(&Work::Mount(volume.clone()), now);
                    self.dirty.insert(volume);
                }
            }
            Completion::Refreshed { volume, result } => {
                self.busy.remove(&volume);
                // What waited for the call (an unpublish) is planned again.
                self.dirty.insert(volume.clone());
                let result = match result {
                    Ok(()) => {
                        tracing::info!(%volume, "refreshed the published volume's credentials");
                        Ok(())
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, detail = %e.detail(), "the published volume's credentials could not be refreshed; its mount keeps the ones it has, tried again after a backoff");
                        Err(e.report())
                    }
                };
                self.refreshes.done(&volume, result, now);
            }
            Completion::Detached { volume, result } => {
                if let Err(e) = result {
                    tracing::warn!(%volume, error = %e, "cannot detach the dead mount");
                }
            }
            Completion::Restarted {
                volume,
                alloc_id,
                result,
            } => self.mount_health.on_restarted(
                &volume,
                &alloc_id,
                result.err().map(|e| e.to_string()),
            ),
        }
    }
}
