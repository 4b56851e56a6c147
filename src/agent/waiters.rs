//! Decides the answer to a prestart caller waiting on `POST /v1/allocations/<id>/publish`:
//! published (every deferred volume of the allocation has this allocation as a user),
//! failed (a publish of one of them failed, the allocation is stopped, belongs elsewhere or
//! does not exist), or "publish timed out" (its deadline passed first). A caller that asked
//! for progress reports ([`crate::api::Progress`]) is also answered early, with why it
//! still waits: at once when the allocation starts to wait for something outside the agent
//! (a claim another node holds, a missing plugin) or that changes (at most one change every
//! [`CHANGE_GAP`] after the first), and when its `progress` time has passed in the call.

use crate::agent::input::ReplyId;
use crate::agent::reconcile::Waiting;
use crate::agent::view::{requests, View};
use crate::api::{ApiError, Progress, PublishReply, PublishedVolume, WaitReport};
use crate::cluster::catalog::Catalogue;
use crate::node::journal::{Journal, UserKey};
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// A change of why an allocation waits is reported at once the first time, and then at most
/// once in this long per call (a holder that flaps cannot flood the prestart's log).
pub(crate) const CHANGE_GAP: Duration = Duration::from_secs(5);

/// The most characters of the reason given to a caller (its prestart prints it in one line
/// under 200 characters, with its own words around it: `Error: publish failed after 2m 0s: `).
pub(crate) const MAX_REASON: usize = 160;

/// One caller waiting for its allocation's volumes.
#[derive(Debug, Clone)]
pub(crate) struct Waiter {
    pub reply: ReplyId,
    pub alloc_id: String,
    /// The namespace of the caller's workload identity.
    pub namespace: String,
    pub deadline: Instant,
    /// When this call arrived.
    pub since: Instant,
    /// The progress reports it asked for.
    pub progress: Option<Progress>,
}

impl Waiter {
    /// When this call is due a progress report even if nothing changed.
    fn report_at(&self) -> Option<Instant> {
        self.progress.as_ref().map(|p| self.since + p.after)
    }
}

/// What a waiter's answer is decided from.
pub(crate) struct Known<'a> {
    pub view: &'a View,
    pub volumes: &'a Catalogue,
    pub journal: &'a Journal,
    /// The last failure of each volume's publish.
    pub last_error: &'a BTreeMap<VolumeKey, String>,
    /// Volumes with a call in flight (a failure recorded before it is stale).
    pub busy: &'a BTreeSet<VolumeKey>,
    /// Volumes this node withholds (attach limit, cool-down), with why: refused at once.
    pub refused: &'a BTreeMap<VolumeKey, String>,
    /// Why volumes wait (plugin missing, claim held elsewhere).
    pub waiting: &'a [Waiting],
    /// Targets where the host's mount table shows what their publish established: a
    /// caller is answered only from these, never from the journal alone.
    pub mounted: &'a BTreeSet<std::path::PathBuf>,
    /// The job of the allocation holding each volume's claim on another node, where known
    /// (the advice given at the end differs when it is the caller's own job).
    pub holder_jobs: &'a BTreeMap<VolumeKey, String>,
}

/// The callers waiting, in arrival order.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    list: Vec<Waiter>,
}

impl Waiters {
    pub(crate) fn push(&mut self, w: Waiter) {
        self.list.push(w);
    }

    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// The allocations the callers wait for.
    pub(crate) fn allocs(&self) -> impl Iterator<Item = &String> + '_ {
        self.list.iter().map(|w| &w.alloc_id)
    }

    /// The earliest deadline or progress report due.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.list
            .iter()
            .flat_map(|w| {
                let change = w
                    .progress
                    .as_ref()
                    .filter(|p| !p.seen.is_empty())
                    .map(|_| w.since + CHANGE_GAP);
                [Some(w.deadline), w.report_at(), change]
            })
            .flatten()
            .min()
    }

    /// Forgets a caller that went away.
    pub(crate) fn gone(&mut self, reply: ReplyId) {
        self.list.retain(|w| w.reply != reply);
    }

    /// Answers every waiter whose outcome is decided at `now`; keeps the others.
    pub(crate) fn answer(
        &mut self,
        k: &Known<'_>,
        now: Instant,
    ) -> Vec<(ReplyId, Result<PublishReply, ApiError>)> {
        let mut out = Vec::new();
        self.list.retain(|w| match outcome(w, k, now) {
            Some(r) => {
                out.push((w.reply, r));
                false
            }
            None => true,
        });
        out
    }

    /// Fails every waiter of `alloc_id` with `err`.
    pub(crate) fn fail(
        &mut self,
        alloc_id: &str,
        err: ApiError,
    ) -> Vec<(ReplyId, Result<PublishReply, ApiError>)> {
        let mut out = Vec::new();
        self.list.retain(|w| {
            if w.alloc_id == alloc_id {
                out.push((w.reply, Err(err.clone())));
                false
            } else {
                true
            }
        });
        out
    }
}

/// `Some` when the waiter can be answered at `now`.
pub(crate) fn outcome(
    w: &Waiter,
    k: &Known<'_>,
    now: Instant,
) -> Option<Result<PublishReply, ApiError>> {
    let Some(alloc) = k.view.allocs().get(w.alloc_id.as_str()) else {
        if now >= w.deadline {
            return Some(Err(ApiError::AllocationNotSeen {
                alloc_id: w.alloc_id.as_str().into(),
            }));
        }
        if w.report_at().is_some_and(|t| now >= t) {
            return Some(Ok(PublishReply {
                alloc_id: w.alloc_id.clone(),
                volumes: Vec::new(),
                waiting: Some(WaitReport::of(format!(
                    "allocation {} is not known on this node yet (the agent reads it from Nomad)",
                    w.alloc_id
                ))),
            }));
        }
        return None;
    };
    if alloc.namespace != w.namespace {
        return Some(Err(ApiError::WrongNamespace {
            token: w.namespace.clone(),
            alloc: alloc.namespace.to_string(),
        }));
    }
    if alloc.is_client_terminal() || alloc.desired_status != "run" {
        return Some(Err(ApiError::AllocationStopped {
            alloc_id: w.alloc_id.clone(),
            client_status: alloc.client_status.to_string(),
            desired_status: alloc.desired_status.to_string(),
        }));
    }
    alloc.job.as_ref()?;
    let reqs = requests(alloc, k.volumes);
    let mut done = Vec::new();
    // Why it waits, for a progress report: outside waits, and what is under way.
    let mut outside = Vec::new();
    let mut under_way = Vec::new();
    for r in &reqs {
        let user = UserKey {
            alloc_id: w.alloc_id.as_str().into(),
            volume: r.volume.clone(),
        };
        let mount = k.journal.mounts().get(&r.volume);
        let mount = mount.filter(|m| k.mounted.contains(&m.target));
        if let (true, Some(m)) = (k.journal.users().contains(&user), mount) {
            done.push(PublishedVolume {
                namespace: r.volume.namespace.to_string(),
                name: r.volume.name.to_string(),
                path: m.target.display().to_string(),
                read_only: m.read_only,
            });
        } else if let Some(why) = k.refused.get(&r.volume) {
            return Some(Err(ApiError::NotOnThisNode {
                volume: r.volume.clone(),
                why: bounded(why, MAX_REASON),
            }));
        } else if let Some(e) = k
            .last_error
            .get(&r.volume)
            .filter(|_| !k.busy.contains(&r.volume))
        {
            return Some(Err(ApiError::PublishFailed {
                volume: r.volume.clone(),
                error: e.clone(),
            }));
        } else if let Some(wt) = k.waiting.iter().find(|x| x.volume == r.volume) {
            if now >= w.deadline {
                let advice = advice(k.holder_jobs.get(&r.volume), &alloc.job_id);
                let reason = bounded(&wt.reason, MAX_REASON.saturating_sub(advice.len()));
                return Some(Err(ApiError::Waiting(format!("{reason}{advice}"))));
            }
            outside.push(wt.reason.as_str());
        } else if k.busy.contains(&r.volume) {
            under_way.push(format!("the publish of {} is under way", r.volume));
        } else {
            under_way.push(format!("{} is not published yet", r.volume));
        }
    }
    if done.len() == reqs.len() {
        return Some(Ok(PublishReply {
            alloc_id: w.alloc_id.clone(),
            volumes: done,
            waiting: None,
        }));
    }
    if now >= w.deadline {
        return Some(Err(ApiError::NotPublishedInTime {
            alloc_id: w.alloc_id.clone(),
        }));
    }
    let p = w.progress.as_ref()?;
    let report = |reason: String| {
        Some(Ok(PublishReply {
            alloc_id: w.alloc_id.clone(),
            volumes: Vec::new(),
            waiting: Some(WaitReport::of(bounded(&reason, MAX_REASON))),
        }))
    };
    if !outside.is_empty() {
        let reason = outside.join("; ");
        let changed = WaitReport::of(bounded(&reason, MAX_REASON)).id != p.seen;
        // The first report at once; later changes at most once per CHANGE_GAP.
        if changed && (p.seen.is_empty() || now >= w.since + CHANGE_GAP) {
            return report(reason);
        }
    }
    if w.report_at().is_some_and(|t| now >= t) {
        let mut all: Vec<String> = outside.iter().map(|s| s.to_string()).collect();
        all.extend(under_way);
        return report(all.join("; "));
    }
    None
}

/// `s` cut to `max` characters (an ellipsis marks a cut).
fn bounded(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut cut: String = s.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// What the caller is told to do when its wait ends on another node's claim, only where
/// it fits: its own job holds the claim (an update or a canary placed on another node) →
/// let the old allocation stop first; another job → nothing to change in this job.
fn advice(holder_job: Option<&String>, job: &str) -> &'static str {
    match holder_job {
        Some(j) if j == job => " (own job: `update { canary = 0, max_parallel = 1 }`)",
        Some(_) => " (it moves when that allocation stops)",
        None => "",
    }
}

#[cfg(test)]
mod tests {
    //! Progress reports decided with plain `Instant`s (the allocation and volumes of the
    //! reconcile tests; no tokio, no Nomad).
    use super::*;
    use crate::agent::reconcile::tests::{alloc, key, volume};

    const A: &str = "00000000-0000-4000-8000-0000000000a1";

    struct Fixture {
        view: View,
        volumes: Catalogue,
        journal: Journal,
        last_error: BTreeMap<VolumeKey, String>,
        busy: BTreeSet<VolumeKey>,
        waiting: Vec<Waiting>,
        mounted: BTreeSet<std::path::PathBuf>,
        holder_jobs: BTreeMap<VolumeKey, String>,
        refused: BTreeMap<VolumeKey, String>,
    }

    impl Fixture {
        fn new() -> Self {
            let mut view = View::default();
            let mut a = alloc(A, &["d"], "pending", "run");
            if let Some(j) = a.job.as_mut().map(std::sync::Arc::make_mut) {
                j.id = "web".into();
            }
            a.job_id = "web".into();
            view.upsert(a);
            Self {
                view,
                volumes: Catalogue::from([(
                    key("d"),
                    std::sync::Arc::new(volume("d", "single-node-writer")),
                )]),
                journal: Journal::new("node-1"),
                last_error: BTreeMap::new(),
                busy: BTreeSet::new(),
                waiting: Vec::new(),
                mounted: BTreeSet::new(),
                holder_jobs: BTreeMap::new(),
                refused: BTreeMap::new(),
            }
        }

        fn known(&self) -> Known<'_> {
            Known {
                view: &self.view,
                volumes: &self.volumes,
                journal: &self.journal,
                last_error: &self.last_error,
                busy: &self.busy,
                waiting: &self.waiting,
                mounted: &self.mounted,
                holder_jobs: &self.holder_jobs,
                refused: &self.refused,
            }
        }

        fn held_by(&mut self, holder: &str) {
            self.waiting = vec![Waiting {
                volume: key("d"),
                reason: format!("single-node claim on default/d held by {holder}"),
            }];
        }
    }

    fn waiter(t0: Instant, seen: &str) -> Waiter {
        Waiter {
            reply: ReplyId(1),
            alloc_id: A.into(),
            namespace: "default".into(),
            deadline: t0 + Duration::from_secs(120),
            since: t0,
            progress: Some(Progress {
                after: Duration::from_secs(30),
                seen: seen.into(),
            }),
        }
    }

    fn report(r: Option<Result<PublishReply, ApiError>>) -> Option<WaitReport> {
        match r {
            Some(Ok(p)) => p.waiting,
            None => None,
            other => panic!("{other:?}"),
        }
    }

    /// Issue 46 #2: a caller that asked for progress is told at once that its allocation
    /// waits and why (the holder), then nothing until its progress time while nothing
    /// changes, and a change at once (after the first, at most one per CHANGE_GAP); one
    /// that did not ask is answered at the end only, with the advice that fits.
    #[test]
    fn a_waiting_caller_is_told_why_at_once_then_at_its_progress_time_and_on_change() {
        let t0 = Instant::now();
        let mut f = Fixture::new();
        let w = waiter(t0, "");
        // Nothing to say yet (the publish is not under way, nothing waits outside).
        assert!(outcome(&w, &f.known(), t0).is_none());
        f.held_by("job other, allocation 1234abcd on node node-2");
        let r = report(outcome(&w, &f.known(), t0)).expect("told at once");
        assert!(
            r.reason
                .contains("held by job other, allocation 1234abcd on node node-2"),
            "{r:?}"
        );
        // The next call, having printed it: nothing new until its progress time.
        let w = waiter(t0, &r.id);
        assert!(outcome(&w, &f.known(), t0 + Duration::from_secs(29)).is_none());
        let tick = report(outcome(&w, &f.known(), t0 + Duration::from_secs(30))).unwrap();
        assert_eq!(tick.id, r.id);
        // A change: at once, once the call is CHANGE_GAP old.
        f.held_by("node node-2 (its allocation stopped)");
        assert!(outcome(&w, &f.known(), t0 + Duration::from_secs(1)).is_none());
        let changed = report(outcome(&w, &f.known(), t0 + CHANGE_GAP)).unwrap();
        assert_ne!(changed.id, r.id);
        // Without progress: the end only, with the advice that fits the holder.
        let mut quiet = waiter(t0, "");
        quiet.progress = None;
        assert!(outcome(&quiet, &f.known(), t0 + Duration::from_secs(60)).is_none());
        f.held_by("job other, allocation 1234abcd on node node-2");
        f.holder_jobs.insert(key("d"), "other".into());
        let end = t0 + Duration::from_secs(120);
        match outcome(&quiet, &f.known(), end) {
            Some(Err(ApiError::Waiting(m))) => {
                assert!(m.contains("it moves when that allocation stops"), "{m}");
                assert!(!m.contains("canary"), "advice that does not fit: {m}");
                assert!(m.chars().count() <= MAX_REASON, "{m}");
            }
            other => panic!("{other:?}"),
        }
        f.holder_jobs.insert(key("d"), "web".into());
        match outcome(&quiet, &f.known(), end) {
            Some(Err(ApiError::Waiting(m))) => assert!(m.contains("canary = 0"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
