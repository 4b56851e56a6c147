//! Stream mode's allocation reads: an event's payload has no Job, so this node's new or
//! server-changed allocations are read in full, off the stream reader, one read each or a
//! burst with one read of the node's allocation list.

use super::*;

impl Watcher {
    /// Stream mode: reads every allocation that may have been deleted with its tasks alive
    /// (a purge or GC emits no event), off the reader through `fetches` like every other
    /// read of the stream path; one whose read is already pending is covered by it. A 404
    /// becomes [`WatchEvent::Removed`] in [`Watcher::fetched`].
    pub(super) fn verify(&self, fetches: &mut Fetches) {
        for id in &self.verifying {
            verify_one(fetches, id);
        }
    }

    /// Stream mode: jobs were deregistered (the Job topic's `JobDeregistered` or
    /// `JobBatchDeregistered`), so maybe deleted (a purge, or the GC of a dead job), and with
    /// them their allocations, running ones included, with no allocation event
    /// (`nomad/state/state_store.go` `DeleteJobTxn` → `deleteAllocsForJobTxn`). Nomad says
    /// which with `Deleted` only from 1.11.3; before, a deletion's payload is `{"Job": …}` as a
    /// stop's is (`nomad/state/events.go` `eventFromChange`). Each allocation of theirs known
    /// here is read at once, off the reader; a 404 becomes [`WatchEvent::Removed`] in
    /// [`Watcher::fetched`].
    pub(super) fn job_deregistered(&self, jobs: &[JobRef], fetches: &mut Fetches) {
        for (id, job) in &self.jobs {
            if jobs.contains(job) {
                tracing::debug!(alloc_id = %id, job = %job.id, namespace = %job.namespace, "the allocation's job was deregistered; reading the allocation");
                verify_one(fetches, id);
            }
        }
    }

    /// Stream mode's process probe: an allocation whose processes are gone is read off the
    /// reader like a deregistered job's; a 404 becomes [`WatchEvent::Removed`].
    pub(super) fn verify_gone(&self, id: &str, fetches: &mut Fetches) {
        tracing::debug!(alloc_id = %id, "the allocation's processes are gone; reading the allocation");
        verify_one(fetches, id);
    }

    /// True when an event of this node's allocation needs the full allocation (with its
    /// Job): it is new to us or changed server-side, and its tasks may still run
    /// ([`Allocation::tasks_finished`]: a `failed` one with a poststop task running does).
    pub(super) fn needs_job(&self, a: &Allocation) -> bool {
        !a.tasks_finished()
            && self
                .known
                .get(&*a.id)
                .is_none_or(|&seen| a.alloc_modify_index > seen)
    }

    /// Handles an event of this node's allocation without waiting for Nomad: one that needs
    /// its Job is read off the reader ([`Fetches`]); one of an allocation whose read is
    /// pending waits behind it, to keep the allocation's updates in order; any other is
    /// sent at once. False when the agent is gone.
    pub(super) async fn allocation(&mut self, mut a: Allocation, fetches: &mut Fetches) -> bool {
        let id = self.share_id(&mut a);
        self.jobs.insert(Arc::clone(&id), job_of(&a));
        if a.tasks_finished() {
            self.live.remove(&*id);
        } else {
            self.live.insert(Arc::clone(&id));
        }
        if a.may_vanish_while_live() {
            self.verifying.insert(id);
        } else {
            self.verifying.remove(&*id);
        }
        if let Some(held) = fetches.waiting.get_mut(&*a.id) {
            held.push(a);
            return true;
        }
        if self.needs_job(&a) {
            fetches.start(a.id.to_string());
            return true;
        }
        self.emit(WatchEvent::Upsert(Box::new(a))).await
    }

    /// A read of the stream path finished: sends it, then the events that arrived for the
    /// allocation meanwhile and are newer than the read (reading again if one of them
    /// needs the Job again). A failed read ends the stream (the relist covers it).
    pub(super) async fn fetched(
        &mut self,
        fetches: &mut Fetches,
        id: String,
        read: Result<Option<Allocation>, NomadError>,
    ) -> Result<(), StreamEnd> {
        let verify_only = fetches.verifies.remove(&id);
        let held = fetches.finish(&id);
        let full = match read {
            Err(e) => return Err(StreamEnd::Fault(Fault::of(&e), e.to_string())),
            Ok(None) => {
                // Gone (garbage-collected or purged): its older updates no longer matter.
                self.forget(&id);
                return if self.emit(WatchEvent::Removed(id)).await {
                    Ok(())
                } else {
                    Err(StreamEnd::Closed)
                };
            }
            Ok(Some(full)) => full,
        };
        let mut full = full;
        let key = self.share_id(&mut full);
        if full.may_vanish_while_live() {
            self.verifying.insert(Arc::clone(&key));
        } else {
            self.verifying.remove(&*key);
        }
        if full.tasks_finished() {
            self.live.remove(&*key);
        } else {
            self.live.insert(Arc::clone(&key));
        }
        if verify_only && held.is_empty() {
            // Still there, and no event arrived meanwhile: the stream brings its changes.
            return Ok(());
        }
        let read_at = full.modify_index;
        self.known.insert(key, full.alloc_modify_index);
        if !self.emit(WatchEvent::Upsert(Box::new(full))).await {
            return Err(StreamEnd::Closed);
        }
        let mut rest = held.into_iter().filter(|a| a.modify_index > read_at);
        while let Some(a) = rest.next() {
            if self.needs_job(&a) {
                // Read again; the events after this one wait behind the new read.
                fetches.start(id.clone());
                if let Some(w) = fetches.waiting.get_mut(&id) {
                    w.extend(rest);
                }
                return Ok(());
            }
            if !self.emit(WatchEvent::Upsert(Box::new(a))).await {
                return Err(StreamEnd::Closed);
            }
        }
        Ok(())
    }
}

/// Reads `id` to see whether it still exists, unless a read of it is pending (which covers it).
fn verify_one(fetches: &mut Fetches, id: &str) {
    if !fetches.waiting.contains_key(id) {
        fetches.verifies.insert(id.to_string());
        fetches.start(id.to_string());
    }
}

/// How many single allocation reads of the stream path run at once.
const FETCH_PARALLEL: usize = 8;

/// Reads waiting to start that are read together through the node's allocation list
/// instead, when they are also at least a quarter of the node's allocations
/// ([`Fetches::flush`]).
const LIST_MIN: usize = 8;

/// One read of the stream path, answered.
pub(super) type Read = (String, Result<Option<Allocation>, NomadError>);

/// What one of the stream path's requests answered.
pub(super) enum Answer {
    /// `GET /v1/allocation/:id`.
    One(Box<Read>),
    /// `GET /v1/node/:id/allocations`, read for the allocations `ids`.
    List(Vec<String>, Result<Vec<ListedAlloc>, NomadError>),
}

/// The stream path's allocation reads (for the Job: an event's payload has none), kept off
/// the stream reader so that a slow read never stalls it: at most one read per allocation
/// (later events of that allocation wait for it, coalesced), at most [`FETCH_PARALLEL`]
/// single reads in flight, the rest queued in arrival order. A burst (at least
/// [`LIST_MIN`] queued reads, and at least a quarter of the node's allocations) is read
/// with one request for the node's allocation list, as poll mode reads it, instead of one
/// request each. Dropped (and its reads cancelled) when the stream ends: the relist that
/// follows covers them.
pub(super) struct Fetches {
    pub(super) client: Client,
    pub(super) node_id: String,
    /// How long one read (single or list) may take before it counts as a dead connection
    /// ([`NomadError::TimedOut`]; the stream then ends and the relist covers the read): the
    /// watcher's idle timeout, as the relist's own.
    pub(super) timeout: Duration,
    pub(super) running: FuturesUnordered<BoxFuture<'static, Answer>>,
    /// Whether one of `running` is a list read (at most one is).
    pub(super) listing: bool,
    pub(super) queued: VecDeque<String>,
    /// Reads that a list answered without their allocation: each is read alone, never
    /// by another list (which would lack it again).
    pub(super) alone: VecDeque<String>,
    /// Allocations with a read queued or in flight, and the events of each that arrived
    /// since, oldest first.
    pub(super) waiting: HashMap<String, Vec<Allocation>>,
    /// Reads started only to verify that the allocation still exists: their answer is
    /// sent on only when it is a deletion or events arrived behind it.
    pub(super) verifies: HashSet<String>,
}

impl Fetches {
    pub(super) fn new(client: Client, node_id: &str, timeout: Duration) -> Self {
        Self {
            client,
            node_id: node_id.to_string(),
            timeout,
            running: FuturesUnordered::new(),
            listing: false,
            queued: VecDeque::new(),
            alone: VecDeque::new(),
            waiting: HashMap::new(),
            verifies: HashSet::new(),
        }
    }

    /// Queues a read of allocation `id`; [`Fetches::flush`] starts it.
    pub(super) fn start(&mut self, id: String) {
        self.waiting.entry(id.clone()).or_default();
        self.queued.push_back(id);
    }

    /// Starts queued reads: all of them as one list read when they are a burst (at least
    /// [`LIST_MIN`], and at least a quarter of the `node_allocs` allocations the node has,
    /// since a list answer carries every one of them), and no list read runs already;
    /// otherwise single reads, as many as free slots allow. Every read covered by a list
    /// was queued before the list is asked for, so the list is at least as new as the
    /// event that asked for the read.
    pub(super) fn flush(&mut self, node_allocs: usize) {
        let queued = self.queued.len();
        if !self.listing && queued >= LIST_MIN && queued * 4 >= node_allocs + queued {
            let ids: Vec<String> = self.queued.drain(..).collect();
            let (client, node) = (self.client.clone(), self.node_id.clone());
            let after = self.timeout;
            self.listing = true;
            self.running.push(Box::pin(async move {
                let list = client.node_allocations_listed(&node, 0, Duration::ZERO);
                let read = within(after, || LIST_WHAT.into(), list)
                    .await
                    .map(|(l, _)| l.value);
                Answer::List(ids, read)
            }));
        }
        while self.running.len() - usize::from(self.listing) < FETCH_PARALLEL {
            let Some(id) = self.alone.pop_front().or_else(|| self.queued.pop_front()) else {
                break;
            };
            let client = self.client.clone();
            let after = self.timeout;
            self.running.push(Box::pin(async move {
                let what = || format!("read allocation {id} (GET /v1/allocation/:id)");
                let read = within(after, what, client.allocation(&id)).await;
                Answer::One(Box::new((id, read)))
            }));
        }
    }

    /// The reads an answer settles. A list answers each allocation it was read for that it
    /// holds (decoded whole then); one it does not hold is read alone, queued again (the
    /// allocation may have been deleted since its event, or be in a namespace the token
    /// lists without: only its own read tells). Errors: the request failed, or an
    /// allocation of the list that was read for is not an allocation (the stream ends
    /// and the relist covers every read, as for a failed single read).
    pub(super) fn answered(&mut self, answer: Answer) -> Result<Vec<Read>, NomadError> {
        match answer {
            Answer::One(read) => Ok(vec![*read]),
            Answer::List(ids, read) => {
                self.listing = false;
                let listed = read?;
                let by_id: HashMap<&str, &ListedAlloc> =
                    listed.iter().map(|l| (l.id.as_str(), l)).collect();
                let mut reads = Vec::with_capacity(ids.len());
                for id in ids {
                    match by_id.get(id.as_str()) {
                        Some(l) => {
                            let full = l.decode().map_err(|source| NomadError::Decode {
                                what: "list the node's allocations (GET /v1/node/:id/allocations)"
                                    .to_string(),
                                source,
                            })?;
                            reads.push((id, Ok(Some(full))));
                        }
                        None => self.alone.push_back(id),
                    }
                }
                Ok(reads)
            }
        }
    }

    /// The read of `id` was answered: returns the events held behind it.
    pub(super) fn finish(&mut self, id: &str) -> Vec<Allocation> {
        let held = self.waiting.remove(id).unwrap_or_default();
        // Give back memory after a burst.
        if self.waiting.is_empty() {
            self.waiting.shrink_to(FETCH_PARALLEL);
            self.queued.shrink_to(FETCH_PARALLEL);
            self.alone.shrink_to(FETCH_PARALLEL);
        }
        held
    }
}
