//! The core's claim decisions: lost claims, fences before a lease ends, late renewals,
//! storage fencing, an operator's release, unfenced writers, releases by the plan.

use super::*;

#[test]
fn a_lost_claim_is_unpublished_and_then_forgotten() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    // Not published before the claim is held.
    let e = h.feed(Input::Tick);
    assert_eq!(publishes(&e), 0);
    let e = h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok("lock".into()),
    }));
    assert!(e.iter().any(|x| matches!(x, Effect::RenewClaim { .. })));
    let e = h.published("d");
    h.committed(&e);
    let sent = h.t + Duration::from_secs(5);
    let e = h.at(
        Duration::from_secs(5),
        Input::Done(Completion::ClaimRenewed {
            volume: key("d"),
            lock_id: "lock".into(),
            sent,
            result: Err(ClaimError::Lost { volume: key("d") }),
        }),
    );
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::StopRenewing { volume } if *volume == key("d"))),
        "{e:?}"
    );
    assert_eq!(
        unpublishes(&e),
        1,
        "claim lost: unpublished first, though still needed"
    );
    let e = h.feed(Input::Done(Completion::Unpublished {
        volume: key("d"),
        result: Ok(()),
    }));
    assert!(
        !e.iter().any(|x| matches!(x, Effect::ReleaseClaim { .. })),
        "a lost claim is not released"
    );
    assert!(h.core.claims.states().is_empty());
}

/// Issue 31: a claim whose renewals fail is fenced a margin before its lease ends, first in
/// the pass, with the mount's target; it is reported in status and the journal; a renewal
/// that succeeds afterwards detaches the fenced mount to publish it again.
#[test]
fn a_claim_not_renewed_in_time_is_fenced_first_and_restored_by_a_renewal() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    // The acquire was sent in the set-up pass (t0): lease end t0 + 2 x 15 + 15, fence at
    // t0 + 30 (margin 15 s).
    let e = h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok("lock".into()),
    }));
    assert!(e.iter().any(|x| matches!(x, Effect::RenewClaim { .. })));
    let e = h.published("d");
    h.committed(&e);
    let e = h.at(Duration::from_secs(5), Input::Tick);
    assert!(
        !e.iter().any(|x| matches!(x, Effect::RenewClaim { .. })),
        "renewals are the renewal thread's"
    );
    let failed = || ClaimError::Nomad {
        volume: key("d"),
        source: crate::nomad::NomadError::Status {
            what: "lock-renew".into(),
            status: 500,
            body: "rpc error: failed to get conn: dial tcp 10.0.0.1:4647: i/o timeout".into(),
        },
    };
    let sent = h.t;
    let e = h.at(
        Duration::from_secs(10),
        Input::Done(Completion::ClaimRenewed {
            volume: key("d"),
            lock_id: "lock".into(),
            sent,
            result: Err(failed()),
        }),
    );
    assert!(
        !e.iter().any(|x| matches!(x, Effect::Fence { .. })),
        "{e:?}"
    );
    // t0 + 30: the pass starts with the fence, whatever its input.
    let sent = h.t;
    let e = h.at(
        Duration::from_secs(15),
        Input::Done(Completion::ClaimRenewed {
            volume: key("d"),
            lock_id: "lock".into(),
            sent,
            result: Err(failed()),
        }),
    );
    assert!(
        matches!(&e[0], Effect::Fence { target: t, .. } if t == &target("d")),
        "{e:?}"
    );
    assert_eq!(publishes(&e), 0);
    let st = h.core.status();
    assert_eq!(st["claims"]["default/d"], "fenced", "{st}");
    assert!(st["fenced"]["default/d"].is_object(), "{st}");
    assert!(
        st["waiting"].to_string().contains("fenced"),
        "the volume waits, saying why: {st}"
    );
    assert!(
        e.iter().any(|x| matches!(x, Effect::Commit { commit, .. }
            if commit.events().iter().any(|ev| ev.kind == EventKind::Fenced))),
        "the fence is written to the journal: {e:?}"
    );
    h.feed(Input::Done(Completion::Fenced {
        volume: key("d"),
        report: crate::node::fence::FenceReport {
            target: target("d"),
            read_only: true,
            ..Default::default()
        },
    }));
    assert_eq!(
        h.core.status()["fenced"]["default/d"]["fence"]["read_only"],
        true
    );
    let e = h.at(Duration::from_secs(5), Input::Tick);
    assert!(
        !e.iter().any(|x| matches!(x, Effect::StopRenewing { .. })),
        "renewals go on"
    );
    let sent = h.t;
    let e = h.feed(Input::Done(Completion::ClaimRenewed {
        volume: key("d"),
        lock_id: "lock".into(),
        sent,
        result: Ok(()),
    }));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::Detach { target: t, .. } if t == &target("d"))),
        "the fenced mount is detached to be published again: {e:?}"
    );
    assert_eq!(h.core.status()["claims"]["default/d"], "held");
}

/// Issue 50: a renewal that succeeded after the core decided a fence, found by the shell
/// right before the fence runs, withdraws it: nothing is killed and nothing republished, the
/// claim is held again with its lease from that renewal's sending. One that succeeds while
/// the fence runs restores the volume once the fence's report is in, not before.
#[test]
fn a_late_renewal_withdraws_the_fence_or_restores_after_a_running_one() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let t0 = h.t;
    let s = Duration::from_secs;
    h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok("lock".into()),
    }));
    let e = h.published("d");
    h.committed(&e);
    let restores = |e: &[Effect]| {
        e.iter()
            .any(|x| matches!(x, Effect::Detach { .. } | Effect::RestartAlloc { .. }))
    };
    // No renewal answered yet: the fence at t0 + 30, for the lease of lock "lock".
    let e = h.at(s(30), Input::Tick);
    assert!(
        matches!(&e[0], Effect::Fence { lease_of: Some(l), .. } if l == "lock"),
        "{e:?}"
    );
    // Right before it ran, the shell found a renewal sent at t0 + 25 that succeeded.
    let e = h.feed(Input::Done(Completion::FenceWithdrawn {
        volume: key("d"),
        lock_id: "lock".into(),
        sent: t0 + s(25),
    }));
    assert!(!restores(&e), "nothing to restore: {e:?}");
    let st = h.core.status();
    assert_eq!(st["claims"]["default/d"], "held", "{st}");
    assert!(st["fenced"]["default/d"].is_null(), "{st}");
    let e = h.feed(Input::Done(Completion::ClaimRenewed {
        volume: key("d"),
        lock_id: "lock".into(),
        sent: t0 + s(25),
        result: Ok(()),
    }));
    assert!(
        !restores(&e),
        "the renewal's own report changes nothing: {e:?}"
    );
    // The lease from t0 + 25: the next fence at t0 + 55, and a renewal that succeeds
    // while that fence runs.
    let e = h.at(s(24), Input::Tick);
    assert!(
        !e.iter().any(|x| matches!(x, Effect::Fence { .. })),
        "{e:?}"
    );
    let e = h.at(s(1), Input::Tick);
    assert!(matches!(&e[0], Effect::Fence { .. }), "{e:?}");
    let e = h.feed(Input::Done(Completion::ClaimRenewed {
        volume: key("d"),
        lock_id: "lock".into(),
        sent: t0 + s(54),
        result: Ok(()),
    }));
    assert!(
        !restores(&e),
        "not before the running fence's report: {e:?}"
    );
    let e = h.feed(Input::Done(Completion::Fenced {
        volume: key("d"),
        report: crate::node::fence::FenceReport {
            target: target("d"),
            read_only: true,
            ..Default::default()
        },
    }));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::Detach { target: t, .. } if t == &target("d"))),
        "the fenced mount is detached to be published again: {e:?}"
    );
    assert_eq!(h.core.status()["claims"]["default/d"], "held");
}

/// Issue 31: the acquire carries the volume's record for the storage-side fence only when the
/// plugin declares `fence_node` (otherwise no `fence_node`/`unfence_node` call is made), and
/// a take-over's fence is recorded in the journal (`node-fenced`).
#[test]
fn an_acquire_fences_at_the_storage_only_with_a_plugin_that_declares_fence_node() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let fencing = |e: &[Effect]| {
        e.iter().find_map(|x| match x {
            Effect::AcquireClaim { fencing, .. } => Some(fencing.is_some()),
            _ => None,
        })
    };
    assert_eq!(
        fencing(&h.setup),
        Some(false),
        "bind without fence_node: {:?}",
        h.setup
    );
    h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Err(ClaimError::Held {
            volume: key("d"),
            holder: "node-2".into(),
            job: None,
        }),
    }));
    h.feed(Input::Done(Completion::Plugins(BTreeMap::from([(
        "bind".to_string(),
        Ok(Fingerprint {
            version: "1".into(),
            deferred_bind: true,
            capabilities: vec!["fence_node".into()],
            ..Default::default()
        }),
    )]))));
    let e = h.at(Duration::from_secs(5), Input::Tick);
    assert_eq!(fencing(&e), Some(true), "{e:?}");
    let e = h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok(crate::cluster::claims::Acquired {
            lock_id: "lock".into(),
            index: 7,
            fence: vec!["node-2".into()],
            unfence: false,
            was_fenced: false,
        }),
    }));
    assert!(
        e.iter().any(|x| matches!(x, Effect::Commit { commit, .. }
            if commit.events().iter().any(|ev| ev.kind == EventKind::NodeFenced
                && ev.detail["fenced_nodes"] == serde_json::json!(["node-2"])))),
        "the take-over's storage-side fence is in the journal: {e:?}"
    );
    assert_eq!(h.core.status()["claims"]["default/d"], "held");
}

/// Issue 46: a node that takes back a claim it held last fences no other node: its
/// `unfence_node` is journaled as `node-unfenced` and shown as `unfence-node`, never as a
/// `fence-node` (a take-over).
#[test]
fn a_node_retaking_its_own_claim_records_no_fence_node() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let e = h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok(crate::cluster::claims::Acquired {
            lock_id: "lock".into(),
            index: 7,
            fence: vec![],
            unfence: true,
            was_fenced: false,
        }),
    }));
    let kinds: Vec<EventKind> = e
        .iter()
        .filter_map(|x| match x {
            Effect::Commit { commit, .. } => Some(commit.events().iter().map(|ev| ev.kind)),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(
        kinds.contains(&EventKind::NodeUnfenced) && !kinds.contains(&EventKind::NodeFenced),
        "{kinds:?}"
    );
    let history = serde_json::to_string(&h.core.node_history()).unwrap();
    assert!(
        history.contains("\"event\":\"unfence-node\"")
            && !history.contains("\"event\":\"fence-node\""),
        "{history}"
    );
}

/// Issue 31: a take-over whose `fence_node` failed (the claim given back by the executor)
/// publishes nothing: the volume waits, saying which call failed for which node, and the
/// acquire is retried.
#[test]
fn a_failed_fence_node_blocks_the_publish_and_is_retried() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let e = h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Err(ClaimError::StorageFence {
            volume: key("d"),
            op: "fence_node",
            node: "node-2".into(),
            error: "export rule not written: server unreachable".into(),
        }),
    }));
    assert_eq!(publishes(&e), 0);
    let w = h.core.status()["waiting"].to_string();
    assert!(
        w.contains("fence_node") && w.contains("node-2") && w.contains("not published"),
        "{w}"
    );
    let e = h.at(Duration::from_secs(5), Input::Tick);
    assert!(
        e.iter().any(|x| matches!(x, Effect::AcquireClaim { .. })),
        "the take-over is retried: {e:?}"
    );
    assert_eq!(publishes(&e), 0);
}

/// Issue 31: a renewal that finds an operator's verified release mark for this very claim
/// (`volume claim release`) fences the volume at once, well before the lease's end, records
/// `claim-released` and `fenced` in the journal, and then unpublishes it as a lost claim.
#[test]
fn an_operator_release_of_this_claim_fences_at_once() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let e = h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok("lock".into()),
    }));
    assert!(e.iter().any(|x| matches!(x, Effect::RenewClaim { .. })));
    let e = h.published("d");
    h.committed(&e);
    h.at(Duration::from_secs(5), Input::Tick);
    // t0 + 5: the lease has 40 s left, its fence moment is 25 s away.
    let sent = h.t;
    let e = h.feed(Input::Done(Completion::ClaimRenewed {
        volume: key("d"),
        lock_id: "lock".into(),
        sent,
        result: Err(ClaimError::ReleasedByOperator {
            volume: key("d"),
            claim_index: 42,
        }),
    }));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::Fence { target: t, .. } if t == &target("d"))),
        "fenced at once: {e:?}"
    );
    let events: Vec<EventKind> = e
        .iter()
        .filter_map(|x| match x {
            Effect::Commit { commit, .. } => Some(commit.events().iter().map(|ev| ev.kind)),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(
        events.contains(&EventKind::ClaimReleased) && events.contains(&EventKind::Fenced),
        "the release and the fence are in the journal: {events:?}"
    );
    assert!(h.core.status()["fenced"]["default/d"].is_object());
    assert_eq!(h.core.status()["claims"]["default/d"], "lost");
}

/// Issue 31: an allocation writing a single-node volume without Nomad's own fence
/// (`disconnect { stop_on_client_after }` within TTL + lock delay) is flagged `unfenced`, and
/// so is one whose `stop_on_client_after` is not longer than the heartbeat interval + 5 s;
/// readers and groups fenced within that window are not.
#[test]
fn a_writer_without_stop_on_client_after_is_flagged_unfenced() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    let st = h.core.status();
    let w = st["unfenced"][A1].as_str().unwrap_or_default().to_string();
    assert!(
        w.contains("stop_on_client_after") && w.contains("30s"),
        "{st}"
    );
    let mut a = alloc(A1, &["d"], "running", "run");
    a.modify_index = 5;
    for g in &mut std::sync::Arc::make_mut(a.job.as_mut().unwrap()).task_groups {
        g.disconnect.stop_on_client_after = Some(Duration::from_secs(45).as_nanos() as u64);
    }
    h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a.clone()))));
    let st = h.core.status();
    assert!(
        st["unfenced"][A1].as_str().unwrap().contains("longer than"),
        "{st}"
    );
    a.modify_index = 6;
    for g in &mut std::sync::Arc::make_mut(a.job.as_mut().unwrap()).task_groups {
        g.disconnect.stop_on_client_after = Some(Duration::from_secs(28).as_nanos() as u64);
    }
    h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a.clone()))));
    assert!(h.core.status()["unfenced"].as_object().unwrap().is_empty());
    // Issue 45: below the client's heartbeat interval (20 s) + 5 s, Nomad stops the healthy
    // allocation between two heartbeats.
    a.modify_index = 7;
    for g in &mut std::sync::Arc::make_mut(a.job.as_mut().unwrap()).task_groups {
        g.disconnect.stop_on_client_after = Some(Duration::from_secs(20).as_nanos() as u64);
    }
    h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
    let st = h.core.status();
    let w = st["unfenced"][A1].as_str().unwrap_or_default();
    assert!(
        w.contains("shorter than its client's heartbeat interval") && w.contains("between 25s"),
        "{st}"
    );
}

#[test]
fn a_claim_is_released_by_the_plan_once_nothing_uses_it() {
    let mut h = H::new(
        &[("d", "single-node-writer")],
        vec![alloc(A1, &["d"], "running", "run")],
    );
    h.feed(Input::Done(Completion::ClaimAcquired {
        volume: key("d"),
        result: Ok("lock".into()),
    }));
    let e = h.published("d");
    h.committed(&e);
    // The node record says the claim is held here (issue 37 #10).
    assert_eq!(h.core.node_volumes()["default/d"].claim, "held");
    let mut a = alloc(A1, &["d"], "complete", "stop");
    a.modify_index = 5;
    h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
    let e = h.feed(Input::Done(Completion::Unpublished {
        volume: key("d"),
        result: Ok(()),
    }));
    let released: Vec<_> = e
        .iter()
        .filter(|x| matches!(x, Effect::ReleaseClaim { lock_id, .. } if lock_id == "lock"))
        .collect();
    assert_eq!(released.len(), 1, "{e:?}");
    let e = h.feed(Input::Tick);
    assert!(
        !e.iter().any(|x| matches!(x, Effect::ReleaseClaim { .. })),
        "once"
    );
}
