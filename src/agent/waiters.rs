//! Decides the answer to a prestart caller waiting on `POST /v1/allocations/<id>/publish`:
//! published (every deferred volume of the allocation has this allocation as a user),
//! failed (a publish of one of them failed, the allocation is stopped, belongs elsewhere or
//! does not exist), or "publish timed out" (its deadline passed first).

use crate::agent::input::ReplyId;
use crate::agent::reconcile::Waiting;
use crate::agent::view::{requests, View};
use crate::api::{ApiError, PublishReply, PublishedVolume};
use crate::cluster::catalog::Catalogue;
use crate::node::journal::{Journal, UserKey};
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// One caller waiting for its allocation's volumes.
#[derive(Debug, Clone)]
pub(crate) struct Waiter {
    pub reply: ReplyId,
    pub alloc_id: String,
    /// The namespace of the caller's workload identity.
    pub namespace: String,
    pub deadline: Instant,
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
    /// Why volumes wait (plugin missing, claim held elsewhere).
    pub waiting: &'a [Waiting],
    /// Targets where the host's mount table shows what their publish established: a
    /// caller is answered only from these, never from the journal alone.
    pub mounted: &'a BTreeSet<std::path::PathBuf>,
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

    /// The earliest deadline.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.list.iter().map(|w| w.deadline).min()
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
    let Some(alloc) = k.view.allocs().get(&w.alloc_id) else {
        if now >= w.deadline {
            return Some(Err(ApiError::AllocationNotSeen {
                alloc_id: w.alloc_id.clone(),
            }));
        }
        return None;
    };
    if alloc.namespace != w.namespace {
        return Some(Err(ApiError::WrongNamespace {
            token: w.namespace.clone(),
            alloc: alloc.namespace.clone(),
        }));
    }
    if alloc.is_client_terminal() || alloc.desired_status != "run" {
        return Some(Err(ApiError::AllocationStopped {
            alloc_id: w.alloc_id.clone(),
            client_status: alloc.client_status.clone(),
            desired_status: alloc.desired_status.clone(),
        }));
    }
    alloc.job.as_ref()?;
    let reqs = requests(alloc, k.volumes);
    let mut done = Vec::new();
    for r in &reqs {
        let user = UserKey {
            alloc_id: w.alloc_id.clone(),
            volume: r.volume.clone(),
        };
        let mount = k.journal.mounts().get(&r.volume);
        let mount = mount.filter(|m| k.mounted.contains(&m.target));
        if let (true, Some(m)) = (k.journal.users().contains(&user), mount) {
            done.push(PublishedVolume {
                namespace: r.volume.namespace.clone(),
                name: r.volume.name.clone(),
                path: m.target.display().to_string(),
                read_only: m.read_only,
            });
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
                return Some(Err(ApiError::Waiting(wt.reason.clone())));
            }
        }
    }
    if done.len() == reqs.len() {
        return Some(Ok(PublishReply {
            alloc_id: w.alloc_id.clone(),
            volumes: done,
        }));
    }
    if now >= w.deadline {
        return Some(Err(ApiError::NotPublishedInTime {
            alloc_id: w.alloc_id.clone(),
        }));
    }
    None
}
