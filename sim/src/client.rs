//! A simulated client node: watches its allocations, runs them, reports status in 200 ms batches.
//!
//! Models `client/client.go` (alloc watching, `allocSyncIntv` = 200 ms batching, `-dev` destroy
//! on shutdown) and `client/allocrunner/alloc_runner.go` + `tasklifecycle/coordinator.go`
//! (prestart → main → poststart → poststop ordering, `getClientStatus`).
//!
//! Heartbeat stop (`client/heartbeatstop.go`, `heartbeatStop.watch` and `shouldStopAfter`):
//! the client keeps the time of its last heartbeat that reached the servers (`lastOk`, set
//! when it starts and on every heartbeat); an allocation whose group sets
//! `disconnect { stop_on_client_after }` (or the older `stop_after_client_disconnect`,
//! `TaskGroup.GetDisconnectStopTimeout`) is destroyed (`stopAlloc` → `AllocRunner.Destroy`:
//! its tasks are killed, poststop ones run, nothing restarts it) once that long has passed
//! since `lastOk` without a heartbeat: here, while the node's heartbeats are stopped (a
//! partition, `PUT /v1/sim/node/:id/partition`).

use crate::store::{ClientAllocUpdate, Server};
use crate::structs::{client_status, Allocation, TaskEvent, TaskState};
use crate::taskrunner::{
    build_alloc_dir, push_event, KillRequest, NodeCtx, Outcome, SharedStates, TaskRunner,
};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Interval at which a client sends batched alloc updates (`allocSyncIntv`).
pub const ALLOC_SYNC_INTERVAL: Duration = Duration::from_millis(200);

/// What the node tells an alloc runner.
#[derive(Debug, Clone)]
enum Directive {
    /// The server's current view of the alloc.
    Alloc(Box<Allocation>),
    /// Alloc deleted from state (purge/GC): killed as a server-side stop is
    /// (`allocRunner.destroyImpl` → `killTasks`: poststop tasks then run).
    Destroy,
    /// The sim agent shuts down: every task is killed, poststop ones included.
    Shutdown,
}

struct RunnerHandle {
    tx: watch::Sender<Directive>,
    join: JoinHandle<()>,
    gone_since: Option<tokio::time::Instant>,
    /// When the runner was added (`heartbeatStop.allocHook`: the watch's timer restarts then,
    /// so it is checked no earlier than its timeout after this).
    hooked: tokio::time::Instant,
}

/// Runs one node until `shutdown` flips to true; then kills every task (with kill timeouts).
pub async fn run_node(server: Arc<Server>, ctx: Arc<NodeCtx>, mut shutdown: watch::Receiver<bool>) {
    let node_id = ctx.node.ID.clone();
    let (upd_tx, mut upd_rx) = mpsc::unbounded_channel::<ClientAllocUpdate>();
    let flush_server = server.clone();
    let flush_node = node_id.clone();
    let (flush_stop_tx, mut flush_stop_rx) = watch::channel(false);
    let flusher = tokio::spawn(async move {
        let mut pending: BTreeMap<String, ClientAllocUpdate> = BTreeMap::new();
        let mut tick = tokio::time::interval(ALLOC_SYNC_INTERVAL);
        loop {
            tokio::select! {
                u = upd_rx.recv() => match u {
                    Some(u) => { pending.insert(u.id.clone(), u); }
                    None => break,
                },
                _ = tick.tick() => {
                    // A partitioned client (heartbeats stopped) cannot reach the servers.
                    if !pending.is_empty() && !flush_server.read().heartbeat_stopped(&flush_node) {
                        let batch = std::mem::take(&mut pending).into_values().collect();
                        if let Err(back) = flush_server.update_allocs_from_client(batch) {
                            // Refused while the node is down: kept, newer updates win.
                            for u in back {
                                pending.entry(u.id.clone()).or_insert(u);
                            }
                        }
                    }
                }
                _ = flush_stop_rx.changed() => break,
            }
        }
        while let Ok(u) = upd_rx.try_recv() {
            pending.insert(u.id.clone(), u);
        }
        // At shutdown a refused batch is dropped, as a client that stops loses its queue.
        let _ = flush_server.update_allocs_from_client(pending.into_values().collect());
    });
    let mut runners: BTreeMap<String, RunnerHandle> = BTreeMap::new();
    let mut finished: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    let mut index_rx = server.subscribe_index();
    // `heartbeatStop.lastOk`: set when the client starts (`watch`) and registers
    // (`registerNode`), then on every heartbeat that succeeds (`updateNodeStatus`), never on a
    // failed one. The client heartbeats once per TTL the server answered with
    // (`registerAndHeartbeat`: `time.After(c.heartbeatTTL)`); a `-dev` client sends its first
    // heartbeat at once and retries a failed one after 1 s (`devModeRetryIntv`).
    let mut last_ok = tokio::time::Instant::now();
    let mut next_heartbeat = last_ok;
    let mut heartbeat_stopped: std::collections::BTreeSet<String> = Default::default();
    let mut was_down = false;
    loop {
        if *shutdown.borrow() {
            break;
        }
        let allocs = server.node_allocs(&node_id);
        let present: std::collections::BTreeSet<String> =
            allocs.iter().map(|a| a.ID.clone()).collect();
        let heartbeating = sim_heartbeating(&server, &node_id);
        let now = tokio::time::Instant::now();
        // The client agent restarting ([`crate::nodes::restart_client`]): its heartbeat stop
        // is a goroutine of the agent, down with it. The agent that comes back starts a new
        // one (`client/heartbeatstop.go` `newHeartbeatStop`, `watch`: `setLastOk(time.Now())`)
        // and hooks every restored allocation again (`allocHook`): the clock starts over.
        let down = server.restarting.borrow().contains(&node_id);
        if was_down && !down {
            last_ok = now;
            next_heartbeat = now;
            for h in runners.values_mut() {
                h.hooked = now;
            }
        }
        was_down = down;
        if now >= next_heartbeat {
            if heartbeating {
                last_ok = now;
                next_heartbeat = now + crate::nodes::heartbeat_ttl(&server);
            } else {
                next_heartbeat = now + Duration::from_secs(1);
            }
        }
        let mut next_stop: Option<tokio::time::Instant> = None;
        // `heartbeatStop.watch`: each allocation with a stop timeout is destroyed once
        // `shouldStopAfter` (now past lastOk + timeout), once: whether the client is cut off
        // or only between two heartbeats further apart than the timeout. Not while the
        // client agent is down (a restart): nothing of it runs then.
        for (id, h) in &runners {
            if heartbeat_stopped.contains(id) || down {
                continue;
            }
            let timeout = match &*h.tx.borrow() {
                Directive::Alloc(a) => stop_timeout(a),
                _ => None,
            };
            let Some(d) = timeout else { continue };
            let due = (last_ok + d).max(h.hooked + d);
            if now > due {
                eprintln!(
                    "nomad-sim: node {node_id}: no heartbeat for {:?} (stop_on_client_after {d:?}): stopping allocation {id}",
                    now - last_ok
                );
                let _ = h.tx.send(Directive::Destroy);
                heartbeat_stopped.insert(id.clone());
            } else {
                let at = due + Duration::from_millis(1);
                next_stop = Some(next_stop.map_or(at, |n| n.min(at)));
            }
        }
        heartbeat_stopped.retain(|id| runners.contains_key(id));
        for a in allocs {
            if !heartbeating {
                break; // a partitioned client does not see server changes
            }
            match runners.get_mut(&a.ID) {
                // Destroyed by the heartbeat stop: no later view of the server revives it.
                Some(_) if heartbeat_stopped.contains(&a.ID) => {}
                Some(h) => {
                    h.gone_since = None;
                    h.tx.send_if_modified(|d| {
                        let changed =
                            !matches!(d, Directive::Alloc(old) if old.ModifyIndex == a.ModifyIndex);
                        if changed {
                            *d = Directive::Alloc(Box::new(a.clone()));
                        }
                        changed
                    });
                }
                None => {
                    if a.client_terminal() || finished.contains(&a.ID) {
                        continue;
                    }
                    let (tx, rx) = watch::channel(Directive::Alloc(Box::new(a.clone())));
                    let join = tokio::spawn(run_alloc(
                        server.clone(),
                        ctx.clone(),
                        a.clone(),
                        rx,
                        upd_tx.clone(),
                    ));
                    runners.insert(
                        a.ID.clone(),
                        RunnerHandle {
                            tx,
                            join,
                            gone_since: None,
                            hooked: tokio::time::Instant::now(),
                        },
                    );
                }
            }
        }
        // Purged/GC'd allocs: the client notices "a moment later" and destroys them.
        for (id, h) in runners.iter_mut() {
            if !present.contains(id) && heartbeating {
                match h.gone_since {
                    None => h.gone_since = Some(now),
                    Some(t) if now.duration_since(t) >= Duration::from_millis(500) => {
                        let _ = h.tx.send(Directive::Destroy);
                    }
                    _ => {}
                }
            }
        }
        runners.retain(|id, h| {
            if h.join.is_finished() {
                finished.insert(id.clone());
            }
            !h.join.is_finished()
        });
        finished.retain(|id| present.contains(id));
        let has_gone = runners.values().any(|h| h.gone_since.is_some());
        let wait = if has_gone {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(1)
        };
        let wait = next_stop.map_or(wait, |t| wait.min(t.saturating_duration_since(now)));
        let wait = wait.min(next_heartbeat.saturating_duration_since(now));
        tokio::select! {
            _ = index_rx.changed() => {}
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => {}
        }
    }
    for h in runners.values() {
        let _ = h.tx.send(Directive::Shutdown);
    }
    for (_, h) in runners {
        let _ = h.join.await;
    }
    let _ = flush_stop_tx.send(true);
    let _ = flusher.await;
}

/// `getDisconnectStopTimeout`: the stop timeout of the allocation's group, if it sets one.
fn stop_timeout(a: &Allocation) -> Option<Duration> {
    a.Job
        .as_ref()?
        .TaskGroups
        .iter()
        .find(|g| g.Name == a.TaskGroup)?
        .stop_on_client_after()
}

fn sim_heartbeating(server: &Server, node_id: &str) -> bool {
    !server.read().heartbeat_stopped(node_id)
}

fn report(
    states: &SharedStates,
    alloc: &Allocation,
    tx: &mpsc::UnboundedSender<ClientAllocUpdate>,
) {
    let snapshot = states.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let (cs, desc) = client_status(&snapshot);
    let _ = tx.send(ClientAllocUpdate {
        id: alloc.ID.clone(),
        node_id: alloc.NodeID.clone(),
        client_status: cs.into(),
        client_description: desc.into(),
        task_states: snapshot,
    });
}

/// The `await_previous_allocations` prerun hook: an allocation that replaces another
/// (`PreviousAllocation`) or preempts others (`PreemptedAllocations`) starts no task until each
/// of them is client-terminal (complete, failed, lost), `unknown`, or gone from the state.
///
/// Nomad: `client/allocrunner/upstream_allocs_hook.go` `upstreamAllocsHook.Prerun` waits on the
/// watcher `client/allocwatcher/alloc_watcher.go` `NewAllocWatcher` builds: `localPrevAlloc.Wait`
/// when the previous allocation's runner is on this node (it returns once that allocation is
/// `Terminated()`), `remotePrevAlloc.Wait` otherwise (blocking `Alloc.GetAlloc` until terminal,
/// `unknown` or GC'd), whatever the ephemeral disk; `sticky`/`migrate` only add the disk
/// migration afterwards, which the sim does not model. Both are read here from the server's
/// view, which the previous allocation's client updates every `ALLOC_SYNC_INTERVAL`. The tasks
/// stay `pending` with their `Received` event meanwhile. Sim: a stop, destroy or shutdown of the
/// waiting allocation ends the wait (Nomad keeps waiting, then runs no task of a stopped
/// allocation either).
async fn await_previous_allocations(
    server: &Server,
    alloc: &Allocation,
    rx: &mut watch::Receiver<Directive>,
) {
    let mut watched: Vec<&str> = Vec::new();
    if !alloc.PreviousAllocation.is_empty() {
        watched.push(&alloc.PreviousAllocation);
    }
    watched.extend(
        alloc
            .PreemptedAllocations
            .iter()
            .flatten()
            .map(String::as_str),
    );
    if watched.is_empty() {
        return;
    }
    let mut index_rx = server.subscribe_index();
    loop {
        let done = {
            let st = server.read();
            watched.iter().all(|id| {
                st.allocs
                    .get(*id)
                    .is_none_or(|p| p.client_terminal() || p.ClientStatus == "unknown")
            })
        };
        let stop = match &*rx.borrow() {
            Directive::Destroy | Directive::Shutdown => true,
            Directive::Alloc(a) => a.server_terminal(),
        };
        if done || stop {
            return;
        }
        tokio::select! {
            r = index_rx.changed() => if r.is_err() { return },
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

struct TaskSlot {
    kill: watch::Sender<Option<KillRequest>>,
    join: Option<JoinHandle<Outcome>>,
    outcome: Option<Outcome>,
}

async fn run_alloc(
    server: Arc<Server>,
    ctx: Arc<NodeCtx>,
    alloc: Allocation,
    mut rx: watch::Receiver<Directive>,
    upd: mpsc::UnboundedSender<ClientAllocUpdate>,
) {
    let Some(job) = alloc.Job.clone().map(|j| *j) else {
        return;
    };
    let Some(group) = job.group(&alloc.TaskGroup).cloned() else {
        return;
    };
    let alloc_dir = ctx.data_dir.join("alloc").join(&alloc.ID);
    let states: SharedStates = Arc::new(Mutex::new(BTreeMap::new()));
    for t in &group.Tasks {
        let mut e = TaskEvent::new("Received");
        e.DisplayMessage = "Task received by client".into();
        states.lock().unwrap_or_else(|e| e.into_inner()).insert(
            t.Name.clone(),
            TaskState {
                State: "pending".into(),
                ..Default::default()
            },
        );
        push_event(&states, &t.Name, e, None);
    }
    report(&states, &alloc, &upd);
    if let Err(e) = build_alloc_dir(&alloc_dir) {
        tracing::error!(alloc = %alloc.ID, error = %e, "building alloc dir");
    }
    await_previous_allocations(&server, &alloc, &mut rx).await;
    let notify: Arc<dyn Fn() + Send + Sync> = {
        let (states, alloc, upd) = (states.clone(), alloc.clone(), upd.clone());
        Arc::new(move || report(&states, &alloc, &upd))
    };
    let node_view: Arc<dyn Fn() -> Option<crate::structs::Node> + Send + Sync> = {
        let (server, id) = (server.clone(), ctx.node.ID.clone());
        Arc::new(move || server.node(&id))
    };
    let mut slots: BTreeMap<String, TaskSlot> = BTreeMap::new();
    // Bumped when this node's client agent comes back from a restart (see
    // `TaskRunner::rerun_prestart_hooks`).
    let (restored_tx, restored_rx) = watch::channel(0u64);
    let mut node_restored = server.restored_tx.subscribe();
    for t in &group.Tasks {
        let (kill, _) = watch::channel(None);
        slots.insert(
            t.Name.clone(),
            TaskSlot {
                kill,
                join: None,
                outcome: None,
            },
        );
    }
    let start = |slots: &mut BTreeMap<String, TaskSlot>, name: &str| {
        let Some(task) = group.Tasks.iter().find(|t| t.Name == name).cloned() else {
            return;
        };
        let slot = slots.get_mut(name).expect("slot");
        let runner = TaskRunner {
            alloc: alloc.clone(),
            job: job.clone(),
            group: group.clone(),
            task,
            node: ctx.clone(),
            alloc_dir: alloc_dir.clone(),
            states: states.clone(),
            notify: notify.clone(),
            node_view: node_view.clone(),
            restored: restored_rx.clone(),
            fresh: !states
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(name)
                .is_some_and(|ts| ts.Events.iter().any(|e| e.Type == "Task Setup")),
        };
        slot.join = Some(tokio::spawn(runner.run(slot.kill.subscribe())));
    };
    let hook = |name: &str| {
        group
            .lifecycle_of(name)
            .map(|(h, sidecar)| (h.to_string(), sidecar))
    };
    let names: Vec<String> = group.Tasks.iter().map(|t| t.Name.clone()).collect();
    let prestart: Vec<String> = names
        .iter()
        .filter(|n| matches!(hook(n), Some((h, _)) if h == "prestart"))
        .cloned()
        .collect();
    let ephemeral_prestart: Vec<String> = names
        .iter()
        .filter(|n| matches!(hook(n), Some((h, false)) if h == "prestart"))
        .cloned()
        .collect();
    let main: Vec<String> = names
        .iter()
        .filter(|n| hook(n).is_none())
        .cloned()
        .collect();
    let poststart: Vec<String> = names
        .iter()
        .filter(|n| matches!(hook(n), Some((h, _)) if h == "poststart"))
        .cloned()
        .collect();
    let poststop: Vec<String> = names
        .iter()
        .filter(|n| matches!(hook(n), Some((h, _)) if h == "poststop"))
        .cloned()
        .collect();

    let wants_stop = |d: &Directive| match d {
        Directive::Destroy | Directive::Shutdown => true,
        Directive::Alloc(a) => a.server_terminal(),
    };
    let mut stopping = wants_stop(&rx.borrow());
    let mut shutdown = matches!(&*rx.borrow(), Directive::Shutdown);
    // Poststop tasks run after a stop only in an allocation that ran.
    let began = !stopping;
    let mut poststop_started = false;
    let mut phase = 0; // 0 prestart, 1 main, 2 poststop, 3 done
    if !stopping {
        for n in &prestart {
            start(&mut slots, n);
        }
        if ephemeral_prestart.is_empty() {
            phase = 1;
            for n in main.iter().chain(poststart.iter()) {
                start(&mut slots, n);
            }
        }
    }
    let mut failed_task: Option<String> = None;
    let mut sibling_failed = false;
    let mut restart_all_pending = false;
    let mut restart_rx = server.restart_tx.subscribe();
    // `alloc restart` requests waiting for their tasks' kill: (tasks, reply).
    type Reply = mpsc::UnboundedSender<Result<(), String>>;
    let mut restart_replies: Vec<(Vec<String>, Reply)> = Vec::new();
    loop {
        // Collect finished tasks.
        for (name, slot) in slots.iter_mut() {
            if slot.outcome.is_none() && slot.join.as_ref().is_some_and(|j| j.is_finished()) {
                let out = slot
                    .join
                    .take()
                    .expect("join")
                    .await
                    .unwrap_or(Outcome::Failed);
                slot.outcome = Some(out);
                if out == Outcome::Failed && failed_task.is_none() {
                    failed_task = Some(name.clone());
                }
            }
        }
        // User-requested restarts: a single task starts again at once; `-all-tasks` waits until
        // every task has stopped and sends the coordinator back to prestart.
        let restarted: Vec<String> = slots
            .iter()
            .filter(|(_, s)| s.outcome == Some(Outcome::Restarted))
            .map(|(n, _)| n.clone())
            .collect();
        // `restartImpl` returns once the task exited (restarted, or ended another way).
        restart_replies.retain_mut(|(tasks, reply)| {
            tasks.retain(|t| slots.get(t).is_some_and(|s| s.outcome.is_none()));
            if tasks.is_empty() {
                let _ = reply.send(Ok(()));
            }
            !tasks.is_empty()
        });
        if !stopping && !restart_all_pending {
            for n in restarted {
                if let Some(s) = slots.get_mut(&n) {
                    s.kill = watch::channel(None).0;
                    s.outcome = None;
                }
                start(&mut slots, &n);
            }
        }
        if !stopping && restart_all_pending && slots.values().all(|s| s.join.is_none()) {
            for s in slots.values_mut() {
                s.kill = watch::channel(None).0;
                s.outcome = None;
            }
            restart_all_pending = false;
            phase = 0;
            for n in &prestart {
                start(&mut slots, n);
            }
            if ephemeral_prestart.is_empty() {
                phase = 1;
                for n in main.iter().chain(poststart.iter()) {
                    start(&mut slots, n);
                }
            }
        }
        let kill_all = |slots: &BTreeMap<String, TaskSlot>, req: KillRequest| {
            for s in slots.values() {
                if s.outcome.is_none() {
                    s.kill.send_replace(Some(req.clone()));
                }
            }
        };
        // Tasks never started are marked dead by their runner; unstarted slots have no runner.
        let mark_unstarted_dead = |slots: &mut BTreeMap<String, TaskSlot>, keep: &[String]| {
            for (name, s) in slots.iter_mut() {
                if s.join.is_none() && s.outcome.is_none() && !keep.contains(name) {
                    s.outcome = Some(Outcome::Killed);
                    let mut st = states.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(ts) = st.get_mut(name) {
                        if let Some(f) = &failed_task {
                            let mut e = TaskEvent::new("Sibling Task Failed");
                            e.DisplayMessage = format!("Task's sibling {f:?} failed");
                            e.FailedSibling = f.clone();
                            ts.Events.push(e);
                        }
                        ts.State = "dead".into();
                        ts.FinishedAt = Some(crate::clock::now_rfc3339());
                    }
                }
            }
        };
        if let Some(f) = &failed_task {
            if !stopping && !sibling_failed {
                // `killTasks` (client/allocrunner/alloc_runner.go): the leader, main and
                // sidecar tasks are killed; poststop tasks are left alone and run once the
                // main tasks are dead, while the allocation already reports `failed`.
                sibling_failed = true;
                for (n, s) in slots.iter() {
                    if s.outcome.is_none() && !poststop.contains(n) {
                        s.kill.send_replace(Some(KillRequest {
                            failed_sibling: f.clone(),
                            no_delay: true,
                            ..Default::default()
                        }));
                    }
                }
                mark_unstarted_dead(&mut slots, &poststop);
                if phase == 0 {
                    phase = 1;
                }
                report(&states, &alloc, &upd);
            }
        }
        if stopping && shutdown {
            kill_all(&slots, KillRequest::default());
            mark_unstarted_dead(&mut slots, &[]);
            report(&states, &alloc, &upd);
            if slots.values().all(|s| s.outcome.is_some()) {
                break;
            }
        } else if stopping {
            // A server-side stop or a deletion (`client/allocrunner/alloc_runner.go`
            // `handleAllocUpdate`, `destroyImpl` → `killTasks`): leader, main and sidecar
            // tasks are killed, never the poststop ones; once every other task is dead the
            // coordinator runs the poststop tasks (`tasklifecycle/coordinator.go`
            // `nextStateLocked`: `isAllocDone` reaches the poststop state from any state).
            for (n, s) in slots.iter() {
                if s.outcome.is_none() && !poststop.contains(n) {
                    s.kill.send_if_modified(|k| {
                        let unset = k.is_none();
                        if unset {
                            *k = Some(KillRequest::default());
                        }
                        unset
                    });
                }
            }
            mark_unstarted_dead(&mut slots, &poststop);
            let others_dead = slots
                .iter()
                .all(|(n, s)| poststop.contains(n) || s.outcome.is_some());
            if others_dead && !poststop_started {
                poststop_started = true;
                phase = 2;
                for n in &poststop {
                    let idle = slots[n].join.is_none() && slots[n].outcome.is_none();
                    if began && idle {
                        start(&mut slots, n);
                    }
                }
                mark_unstarted_dead(&mut slots, &[]);
            }
            report(&states, &alloc, &upd);
            if slots.values().all(|s| s.outcome.is_some()) {
                break;
            }
        } else if !restart_all_pending {
            match phase {
                0 => {
                    let done = ephemeral_prestart
                        .iter()
                        .all(|n| slots[n].outcome == Some(Outcome::Success));
                    if done {
                        phase = 1;
                        for n in main.iter().chain(poststart.iter()) {
                            start(&mut slots, n);
                        }
                    }
                }
                1 => {
                    let main_done = main.iter().all(|n| slots[n].outcome.is_some());
                    if main_done {
                        // Main tasks dead: stop sidecars, then run poststop tasks.
                        for (n, s) in slots.iter() {
                            if s.outcome.is_none() && !poststop.contains(n) {
                                s.kill.send_replace(Some(KillRequest {
                                    reason: "Main Tasks Dead".into(),
                                    ..Default::default()
                                }));
                            }
                        }
                        phase = 2;
                        for n in &poststop {
                            start(&mut slots, n);
                        }
                    }
                }
                2 => {
                    if slots.values().all(|s| s.outcome.is_some()) {
                        phase = 3;
                        report(&states, &alloc, &upd);
                    }
                }
                _ => break,
            }
        }
        tokio::select! {
            r = rx.changed() => {
                if r.is_err() || wants_stop(&rx.borrow()) { stopping = true; }
                if r.is_err() || matches!(&*rx.borrow(), Directive::Shutdown) { shutdown = true; }
                // Back from a disconnect: the server has the allocation `unknown`; the client
                // logs "Reconnected" on every task and sends its state (`alloc_runner.go`
                // `Reconnect`, `client.go` `updateAlloc`).
                let unknown = matches!(&*rx.borrow(), Directive::Alloc(a) if a.ClientStatus == "unknown");
                if unknown && !stopping {
                    for t in &group.Tasks {
                        let mut e = TaskEvent::new("Reconnected");
                        e.DisplayMessage = "Client reconnected".into();
                        push_event(&states, &t.Name, e, None);
                    }
                    report(&states, &alloc, &upd);
                }
            }
            r = node_restored.recv() => {
                if matches!(r, Ok(ref n) if *n == ctx.node.ID) && !stopping {
                    restored_tx.send_modify(|g| *g += 1);
                }
            }
            r = restart_rx.recv() => {
                if let Ok(req) = r {
                    if req.alloc_id == alloc.ID && stopping {
                        // `restartTasks`: `shouldRun` is false once the allocation stops.
                        let _ = req.reply.send(Err("restart of an alloc that should not run".into()));
                    } else if req.alloc_id == alloc.ID {
                        if req.all_tasks {
                            restart_all_pending = true;
                        }
                        let restart = Some(KillRequest { restart: true, no_delay: true, ..Default::default() });
                        let mut killed = Vec::new();
                        for (n, s) in slots.iter() {
                            // `TaskRunner.Restart`: a pending or dead task is not running.
                            let state_running = states
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get(n)
                                .is_some_and(|t| t.State == "running");
                            let running = s.join.is_some() && s.outcome.is_none() && state_running;
                            if running && (req.task.is_empty() || req.task == *n) {
                                s.kill.send_replace(restart.clone());
                                killed.push(n.clone());
                            }
                        }
                        if !req.task.is_empty() && killed.is_empty() {
                            // `RestartTask` → `TaskRunner.Restart`: `ErrTaskNotRunning`.
                            let _ = req.reply.send(Err("Task not running".into()));
                        } else if killed.is_empty() {
                            // `restartTasks` ignores `ErrTaskNotRunning`.
                            let _ = req.reply.send(Ok(()));
                        } else {
                            restart_replies.push((killed, req.reply.clone()));
                        }
                    }
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    for (_, reply) in restart_replies {
        let _ = reply.send(Ok(()));
    }
    report(&states, &alloc, &upd);
}
