//! Decides this node's single-node claims ([`crate::cluster::claims`]): which claims the
//! renewal thread renews ([`crate::agent::renewer`], every TTL/3 on its own schedule, out of
//! the loop's reach), what a failed acquire means for the caller waiting on the volume, when
//! a claim is lost ("claim lost": a renewal that finds the lock gone), and when the node must
//! fence itself.
//!
//! **The lease.** Nomad arms a lock's timer with 2 x TTL when it takes an acquire or a renewal
//! and keeps the lock for the lock delay after the timer fires (`nomad/locks.go`,
//! `CreateVariableLockTTLTimer`, `invalidateVariableLock`). Nomad receives a call after it was
//! sent, so no other node can take the claim before `sent + 2 x TTL + lock delay`, where `sent`
//! is when this node sent its last acquire or renewal that succeeded. That moment is the
//! claim's *lease end*, measured on this node's monotonic clock (only clock *rates* matter,
//! not clock sync). A `fence_margin` before it (default one TTL), a claim whose renewals have
//! not succeeded is *fenced*: the core makes the volume unwritable on this node without the
//! network (see [`crate::node::fence`]) before anything else. A later successful renewal of
//! the same lock restores the volume; a renewal that finds the lock gone loses the claim (the
//! volume is unpublished once its holders are gone). Whether a claim is taken or given back is
//! the plan's decision ([`crate::agent::reconcile`]); this module keeps the claims' state and
//! timing.

use crate::agent::effect::Effect;
use crate::agent::reconcile::{ClaimState, Waiting};
use crate::agent::retry::{Work, CLAIM_RETRY};
use crate::cluster::claims::{Acquired, ClaimError, ClaimSettings};
use crate::node::journal::MountRecord;
use crate::nomad::retry::Retries;
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// This node's claim on one volume.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    pub id: String,
    pub state: ClaimState,
    /// When the last renewal outcome arrived (a claim restored after a restart whose first
    /// renewal failed is fenced from here).
    pub renewed: Instant,
    /// The claim's lease end: no other node can take it before this moment (see the module
    /// documentation). `None` after a restart, until a renewal succeeds: how long the agent
    /// was down is unknown.
    pub lease_end: Option<Instant>,
    /// A renewal failed since the last one that succeeded.
    pub failing: bool,
}

/// What a finished renewal changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Renewed (or failed and retried): nothing else to do.
    Kept,
    /// A fenced claim was renewed: it is still this node's, restore the volume.
    Restored,
    /// The lock is gone: another node may use the volume now.
    Lost,
    /// An operator released the claim (a verified mark for this claim): another node may
    /// publish now, so the volume is fenced here at once, then unpublished (as lost).
    Released,
}

/// Every claim of this node, and why publishes wait for one.
#[derive(Debug)]
pub(crate) struct Claims {
    settings: ClaimSettings,
    held: BTreeMap<VolumeKey, Claim>,
    /// Volumes whose acquire failed, with the reason a waiting caller is told.
    wait: BTreeMap<VolumeKey, String>,
    /// Orders for the renewal thread not handed out yet ([`Claims::orders`]).
    orders: Vec<Effect>,
    /// Of the volumes in `wait`, the job of the holder's allocation, where known.
    holder_jobs: BTreeMap<VolumeKey, String>,
    /// Acquires in flight, with when they were sent.
    acquiring: BTreeMap<VolumeKey, Instant>,
    /// Moves whenever a claim's state may have changed (see [`Claims::version`]).
    version: u64,
}

impl Claims {
    pub(crate) fn new(settings: ClaimSettings) -> Self {
        Self {
            settings,
            held: BTreeMap::new(),
            wait: BTreeMap::new(),
            orders: Vec::new(),
            holder_jobs: BTreeMap::new(),
            acquiring: BTreeMap::new(),
            version: 0,
        }
    }

    /// A number that moves whenever a claim is taken, renewed, fenced, lost or given back,
    /// or a volume starts or stops waiting for one: the metrics count the claims again
    /// only when it moved (O(1) per pass otherwise).
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// This node's claims by state and the volumes waiting for one: `[held, fenced, lost,
    /// waiting]` (a pass over the claims: ask when [`Claims::version`] moved).
    pub(crate) fn counts(&self) -> [usize; 4] {
        let mut n = [0; 4];
        for c in self.held.values() {
            n[match c.state {
                ClaimState::Held => 0,
                ClaimState::Fenced => 1,
                ClaimState::Lost => 2,
            }] += 1;
        }
        n[3] = self.waiting().count();
        n
    }

    /// Claims recorded in the journal before a restart are renewed at once: a renewal that
    /// finds the lock gone means another node may have the volume now, and the mount here is
    /// removed first; one that fails otherwise fences the volume at once (the lease's end is
    /// unknown after a restart), unless [`Claims::restore_leases`] gave the lease end back.
    pub(crate) fn restore<'a>(
        &mut self,
        mounts: impl IntoIterator<Item = &'a MountRecord>,
        now: Instant,
    ) {
        let stale = now.checked_sub(self.settings.ttl).unwrap_or(now);
        self.version += 1;
        for m in mounts {
            if let Some(id) = &m.claim_id {
                self.orders.push(Effect::RenewClaim {
                    volume: m.volume.clone(),
                    lock_id: id.to_string(),
                    acquired_index: None,
                    at_once: true,
                });
                self.held.insert(
                    m.volume.clone(),
                    Claim {
                        id: id.to_string(),
                        state: ClaimState::Held,
                        renewed: stale,
                        lease_end: None,
                        failing: false,
                    },
                );
            }
        }
    }

    /// The leases of claims restored after a restart on the same boot, from the renewals
    /// kept on disk ([`crate::node::leases`]): volume → (lock ID, how long before `now` its
    /// last renewal that succeeded was sent). A claim whose lock ID matches gets its lease
    /// end back, so a failed first renewal fences it a margin before that end, not at once;
    /// one whose fence moment has already passed keeps an unknown lease (fenced at its first
    /// failed renewal, as without the file). Returns the claims whose lease was restored,
    /// with when their renewal was sent.
    pub(crate) fn restore_leases(
        &mut self,
        ages: &BTreeMap<VolumeKey, (String, std::time::Duration)>,
        now: Instant,
    ) -> Vec<(VolumeKey, String, Instant)> {
        let mut restored = Vec::new();
        for (k, c) in self.held.iter_mut() {
            let Some((id, age)) = ages.get(k) else {
                continue;
            };
            let Some(sent) = now.checked_sub(*age) else {
                continue;
            };
            let end = sent + self.settings.ttl * 2 + self.settings.lock_delay;
            let fence_at = end.checked_sub(self.settings.fence_margin).unwrap_or(end);
            if *id != c.id || c.lease_end.is_some() || now >= fence_at {
                continue;
            }
            c.lease_end = Some(end);
            restored.push((k.clone(), id.clone(), sent));
        }
        if !restored.is_empty() {
            self.version += 1;
        }
        restored
    }

    /// Each claim's state, for the plan.
    pub(crate) fn states(&self) -> BTreeMap<VolumeKey, ClaimState> {
        self.held
            .iter()
            .map(|(k, c)| (k.clone(), c.state))
            .collect()
    }

    /// The states of the claims on `volumes` (a scoped planning pass).
    pub(crate) fn states_of(
        &self,
        volumes: &BTreeSet<VolumeKey>,
    ) -> BTreeMap<VolumeKey, ClaimState> {
        volumes
            .iter()
            .filter_map(|k| self.held.get(k).map(|c| (k.clone(), c.state)))
            .collect()
    }

    /// The lock ID of this node's claim on `volume`.
    pub(crate) fn lock_id(&self, volume: &VolumeKey) -> Option<&str> {
        self.held.get(volume).map(|c| c.id.as_str())
    }

    /// The orders for the renewal thread decided since the last call: start renewing a
    /// claim taken or restored, stop renewing one released, lost or forgotten.
    pub(crate) fn orders(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.orders)
    }

    fn stop_renewing(&mut self, volume: &VolumeKey) {
        self.orders.push(Effect::StopRenewing {
            volume: volume.clone(),
        });
    }

    /// The claim on `volume` is about to be released: its renewals stop first.
    pub(crate) fn releasing(&mut self, volume: &VolumeKey) {
        self.stop_renewing(volume);
    }

    /// An acquire of `volume` is sent at `now` (its lease runs from here if it succeeds).
    pub(crate) fn acquire_sent(&mut self, volume: &VolumeKey, now: Instant) {
        self.acquiring.insert(volume.clone(), now);
    }

    /// When a held claim is fenced: a margin before its lease end, or at once for a claim
    /// restored after a restart whose first renewal failed.
    fn fence_at(&self, c: &Claim) -> Option<Instant> {
        match c.lease_end {
            Some(end) => Some(end.checked_sub(self.settings.fence_margin).unwrap_or(end)),
            None if c.failing => Some(c.renewed),
            None => None,
        }
    }

    /// The claims whose fence moment has come at `now` without a renewal that succeeded:
    /// each is marked fenced and returned (the core fences the volume before anything else).
    /// Checked first on every pass, so an agent that was paused (SIGSTOP, a suspended VM)
    /// fences before it acts on anything else.
    pub(crate) fn fences_due(&mut self, now: Instant) -> Vec<VolumeKey> {
        let due: Vec<VolumeKey> = self
            .held
            .iter()
            .filter(|(_, c)| c.state == ClaimState::Held)
            .filter(|(_, c)| self.fence_at(c).is_some_and(|t| now >= t))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &due {
            if let Some(c) = self.held.get_mut(k) {
                c.state = ClaimState::Fenced;
            }
        }
        if !due.is_empty() {
            self.version += 1;
        }
        due
    }

    /// The lease end of this node's claim on `volume`, when known.
    pub(crate) fn lease_end(&self, volume: &VolumeKey) -> Option<Instant> {
        self.held.get(volume).and_then(|c| c.lease_end)
    }

    /// When the next fence is due (renewals are the renewal thread's).
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.held
            .values()
            .filter(|c| c.state == ClaimState::Held)
            .filter_map(|c| self.fence_at(c))
            .min()
    }

    /// The lease end of a lock taken or renewed by a call sent at `sent`: Nomad arms the
    /// lock's timer with 2 x TTL on an acquire (`nomad/locks.go`
    /// `CreateVariableLockTTLTimer`) and re-arms it with 2 x TTL on a renewal (`RenewTTLTimer`
    /// doubles the TTL too; `nomad/lock/ttl.go` `Create` resets the running timer), then
    /// keeps the lock for the lock delay.
    fn lease_from(&self, sent: Instant) -> Instant {
        sent + self.settings.ttl * 2 + self.settings.lock_delay
    }

    /// An acquire finished. A failure keeps the volume waiting, with the reason a caller
    /// is told, and retries soon (claims are retried faster than plugin calls: the holder
    /// may let go any moment).
    pub(crate) fn on_acquired(
        &mut self,
        volume: VolumeKey,
        result: Result<Acquired, ClaimError>,
        retries: &mut Retries<Work>,
        now: Instant,
    ) {
        self.version += 1;
        match result {
            Ok(acq) => {
                tracing::info!(%volume, "claim acquired");
                self.wait.remove(&volume);
                self.holder_jobs.remove(&volume);
                retries.succeeded(&Work::Claim(volume.clone()));
                let sent = self.acquiring.remove(&volume).unwrap_or(now);
                let lease_end = Some(self.lease_from(sent));
                self.orders.push(Effect::RenewClaim {
                    volume: volume.clone(),
                    lock_id: acq.lock_id.clone(),
                    acquired_index: (acq.index > 0).then_some(acq.index),
                    at_once: false,
                });
                self.held.insert(
                    volume,
                    Claim {
                        id: acq.lock_id,
                        state: ClaimState::Held,
                        renewed: now,
                        lease_end,
                        failing: false,
                    },
                );
            }
            Err(e) => {
                self.acquiring.remove(&volume);
                // One short line (a prestart prints it as it starts to wait, and at the
                // end with the advice that fits: agent/waiters.rs).
                let reason = match &e {
                    ClaimError::Held { holder, .. } => {
                        format!("single-node claim on {volume} held by {holder}")
                    }
                    _ => format!("cannot take the claim: {e}"),
                };
                match &e {
                    ClaimError::Held { job: Some(j), .. } => {
                        self.holder_jobs.insert(volume.clone(), j.clone())
                    }
                    _ => self.holder_jobs.remove(&volume),
                };
                if self.wait.get(&volume) != Some(&reason) {
                    tracing::info!(%volume, reason = %e, "publish waits for the claim");
                }
                retries.failed(&Work::Claim(volume.clone()), CLAIM_RETRY, now);
                self.wait.insert(volume, reason);
            }
        }
    }

    /// A renewal of the claim under `lock_id`, sent at `sent`, finished (an outcome for
    /// another lock, one released or replaced since, changes nothing). "Claim lost": the
    /// lock is gone (expired, or taken over), so another node may use the volume now; the
    /// plan unpublishes it here before anything else. Any other failure is retried by the
    /// renewal thread after half a renewal period (the fence comes at its own time,
    /// [`Claims::fences_due`]). A success extends the lease from when the renewal was
    /// *sent*, however late its answer came, and restores a fenced claim.
    pub(crate) fn on_renewed(
        &mut self,
        volume: &VolumeKey,
        lock_id: &str,
        sent: Instant,
        result: Result<(), ClaimError>,
        mounted_here: bool,
        now: Instant,
    ) -> Renewal {
        if self.held.get(volume).is_none_or(|c| c.id != lock_id) {
            return Renewal::Kept;
        }
        self.version += 1;
        match result {
            Ok(()) => {
                let end = self.lease_from(sent);
                let Some(c) = self.held.get_mut(volume) else {
                    return Renewal::Kept;
                };
                c.renewed = now;
                c.failing = false;
                // Replaced, not extended: Nomad resets the timer on a renewal (to 2 x TTL from
                // when it arrives), so the lease runs from this renewal's sending.
                c.lease_end = Some(end);
                if c.state == ClaimState::Fenced {
                    c.state = ClaimState::Held;
                    tracing::warn!(%volume, "claim renewed after the fence: it is still this node's; restoring the volume");
                    return Renewal::Restored;
                }
                Renewal::Kept
            }
            // A refusal that proves no other holder is lost only once the lease has ended
            // (the lock may have lapsed with no one taking it); before, it is retried.
            Err(ClaimError::Unproven { volume: v })
                if self
                    .held
                    .get(volume)
                    .and_then(|c| c.lease_end)
                    .is_some_and(|end| now >= end) =>
            {
                self.on_renewed(
                    volume,
                    lock_id,
                    sent,
                    Err(ClaimError::Lost { volume: v }),
                    mounted_here,
                    now,
                )
            }
            Err(e @ ClaimError::ReleasedByOperator { .. }) => {
                tracing::error!(%volume, reason = %e, "claim released by an operator: fencing the volume here at once, then unpublishing it");
                self.stop_renewing(volume);
                if let Some(c) = self.held.get_mut(volume) {
                    c.state = ClaimState::Lost;
                }
                if !mounted_here {
                    self.held.remove(volume);
                }
                Renewal::Released
            }
            Err(e @ ClaimError::Lost { .. }) => {
                tracing::warn!(%volume, reason = %e, "claim lost: another node may use the volume now; unpublishing here before anything else");
                self.stop_renewing(volume);
                if let Some(c) = self.held.get_mut(volume) {
                    c.state = ClaimState::Lost;
                }
                if !mounted_here {
                    self.held.remove(volume);
                }
                Renewal::Lost
            }
            Err(e) => {
                if let Some(c) = self.held.get_mut(volume) {
                    let left = c
                        .lease_end
                        .map(|end| end.saturating_duration_since(now).as_secs());
                    tracing::warn!(%volume, error = %e, lease_left_secs = ?left, "claim renewal failed; retrying (the volume is fenced here if no renewal succeeds before its lease ends)");
                    c.failing = true;
                    c.renewed = now;
                }
                Renewal::Kept
            }
        }
    }

    /// The volume was unpublished here: a lost claim is forgotten (a held one is given
    /// back by the plan, unless an allocation here still needs the volume).
    pub(crate) fn on_unpublished(&mut self, volume: &VolumeKey) {
        self.version += 1;
        if self
            .held
            .get(volume)
            .is_some_and(|c| c.state == ClaimState::Lost)
        {
            self.held.remove(volume);
        }
    }

    /// A release finished; the claim is forgotten either way (a failed release expires
    /// with its TTL).
    pub(crate) fn on_released(&mut self, volume: &VolumeKey, result: Result<(), ClaimError>) {
        self.version += 1;
        if let Err(e) = result {
            tracing::warn!(%volume, error = %e, "claim release failed; it expires with its TTL");
        }
        self.held.remove(volume);
    }

    /// Ends the waits of the volumes `done` says no publish waits for any more (the
    /// allocations that needed them ended): a wait is kept only while the plan still asks
    /// for the claim.
    pub(crate) fn forget_waits(&mut self, done: impl Fn(&VolumeKey) -> bool) {
        let before = self.wait.len();
        self.wait.retain(|k, _| !done(k));
        let wait = &self.wait;
        self.holder_jobs.retain(|k, _| wait.contains_key(k));
        if self.wait.len() != before {
            self.version += 1;
        }
    }

    /// Of the volumes waiting for a claim, the job of the holder's allocation, where known.
    pub(crate) fn holder_jobs(&self) -> &BTreeMap<VolumeKey, String> {
        &self.holder_jobs
    }

    /// Volumes waiting for a claim this node does not hold, with the reason.
    pub(crate) fn waiting(&self) -> impl Iterator<Item = Waiting> + '_ {
        self.wait
            .iter()
            .filter(|(k, _)| !self.held.contains_key(*k))
            .map(|(volume, reason)| Waiting {
                volume: volume.clone(),
                reason: reason.clone(),
            })
    }

    /// For `dhv-binder status`: volume → "held" / "fenced" / "lost".
    pub(crate) fn status(&self) -> BTreeMap<String, String> {
        self.held
            .iter()
            .map(|(k, c)| (k.to_string(), format!("{:?}", c.state).to_lowercase()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key() -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: "db".into(),
        }
    }

    fn claims() -> Claims {
        Claims::new(ClaimSettings {
            ttl: Duration::from_secs(15),
            lock_delay: Duration::from_secs(15),
            fence_margin: Duration::from_secs(15),
        })
    }

    fn held(c: &mut Claims, now: Instant) {
        let mut r = Retries::new(1);
        c.on_acquired(key(), Ok("lock-1".into()), &mut r, now);
    }

    /// Issue 37 #13: the counts behind `dhv_binder_claims{state}`, and a version that
    /// moves with every change of them (the meter counts again only then).
    #[test]
    fn the_claims_are_counted_by_state_and_each_change_moves_the_version() {
        let t0 = Instant::now();
        let mut c = claims();
        assert_eq!(c.counts(), [0, 0, 0, 0]);
        let mut r = Retries::new(1);
        let other = VolumeKey {
            namespace: "default".into(),
            name: "logs".into(),
        };
        let v = c.version();
        c.on_acquired(
            other.clone(),
            Err(ClaimError::Held {
                volume: other.clone(),
                holder: "job web, allocation 1234abcd on node node-2".into(),
                job: Some("web".into()),
            }),
            &mut r,
            t0,
        );
        assert_eq!(c.counts(), [0, 0, 0, 1], "one volume waits");
        assert!(c.version() > v);
        let v = c.version();
        held(&mut c, t0);
        assert_eq!(c.counts(), [1, 0, 0, 1]);
        assert!(c.version() > v);
        // Orders for the renewal thread change nothing counted; the fence does.
        let v = c.version();
        assert_eq!(c.orders().len(), 1);
        assert_eq!(c.version(), v);
        assert_eq!(c.fences_due(t0 + Duration::from_secs(31)), vec![key()]);
        assert_eq!(c.counts(), [0, 1, 0, 1]);
        assert!(c.version() > v);
        let v = c.version();
        let lost = c.on_renewed(
            &key(),
            "lock-1",
            t0 + Duration::from_secs(30),
            Err(ClaimError::Lost { volume: key() }),
            true,
            t0 + Duration::from_secs(32),
        );
        assert_eq!(lost, Renewal::Lost);
        assert_eq!(c.counts(), [0, 0, 1, 1]);
        assert!(c.version() > v);
        let v = c.version();
        c.on_unpublished(&key());
        assert_eq!(c.counts(), [0, 0, 0, 1]);
        assert!(c.version() > v);
    }

    #[test]
    fn an_unproven_refusal_is_retried_until_the_lease_ends_then_lost() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        let unproven = || ClaimError::Unproven { volume: key() };
        let at = |s| t0 + Duration::from_secs(s);
        let r = c.on_renewed(&key(), "lock-1", at(4), Err(unproven()), true, at(5));
        assert_eq!(r, Renewal::Kept);
        assert_eq!(c.status()["default/db"], "held");
        // The acquire's lease: 2 x TTL + lock delay = 45 s.
        let r = c.on_renewed(&key(), "lock-1", at(44), Err(unproven()), true, at(46));
        assert_eq!(r, Renewal::Lost);
        assert_eq!(c.status()["default/db"], "lost");
    }

    /// Issue 50: a claim taken is handed to the renewal thread (renewed on its schedule,
    /// not the loop's); the loop wakes only for the fence.
    #[test]
    fn a_taken_claim_is_handed_to_the_renewal_thread() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        assert!(matches!(
            &c.orders()[..],
            [Effect::RenewClaim { lock_id, at_once: false, .. }] if lock_id == "lock-1"
        ));
        assert!(c.orders().is_empty(), "handed out once");
        assert_eq!(c.next_wakeup(), Some(t0 + Duration::from_secs(30)));
    }

    /// An outcome for another lock (released or replaced since) changes nothing.
    #[test]
    fn an_outcome_for_another_lock_changes_nothing() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        let r = c.on_renewed(
            &key(),
            "lock-0",
            t0,
            Err(ClaimError::Lost { volume: key() }),
            true,
            t0 + Duration::from_secs(1),
        );
        assert_eq!(r, Renewal::Kept);
        assert_eq!(c.status()["default/db"], "held");
    }

    #[test]
    fn a_renewal_that_finds_the_lock_gone_loses_the_claim() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        c.orders();
        c.on_renewed(
            &key(),
            "lock-1",
            t0 + Duration::from_secs(5),
            Err(ClaimError::Lost { volume: key() }),
            true,
            t0 + Duration::from_secs(5),
        );
        assert_eq!(c.states()[&key()], ClaimState::Lost);
        assert!(
            matches!(&c.orders()[..], [Effect::StopRenewing { volume }] if *volume == key()),
            "a lost claim is no longer renewed"
        );
        c.on_unpublished(&key());
        assert!(c.states().is_empty(), "forgotten once unpublished");
    }

    #[test]
    fn a_lost_claim_with_nothing_mounted_is_forgotten_at_once() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        c.on_renewed(
            &key(),
            "lock-1",
            t0,
            Err(ClaimError::Lost { volume: key() }),
            false,
            t0,
        );
        assert!(c.states().is_empty());
    }

    #[test]
    fn a_claim_held_elsewhere_makes_the_publish_wait_and_retries_soon() {
        let t0 = Instant::now();
        let mut c = claims();
        let mut r = Retries::new(1);
        let err = ClaimError::Held {
            volume: key(),
            holder: "job web, allocation 1234abcd on node node-2".into(),
            job: Some("web".into()),
        };
        c.on_acquired(key(), Err(err), &mut r, t0);
        let w: Vec<Waiting> = c.waiting().collect();
        // Issue 46 #2: one short line naming the holder; the advice that fits is added by
        // the answer at the end (agent/waiters.rs), where the waiting job is known.
        assert_eq!(
            w[0].reason,
            "single-node claim on default/db held by job web, allocation 1234abcd on node node-2"
        );
        assert_eq!(c.holder_jobs().get(&key()).map(String::as_str), Some("web"));
        assert!(!r.ready(&Work::Claim(key()), t0));
        assert!(r.ready(&Work::Claim(key()), t0 + Duration::from_millis(600)));
        held(&mut c, t0);
        assert_eq!(c.waiting().count(), 0);
        assert!(c.holder_jobs().is_empty());
    }

    #[test]
    fn claims_from_the_journal_are_renewed_at_once_after_a_restart() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let mut c = claims();
        let mut m = crate::node::journal::tests::rec(crate::node::journal::MountState::Published);
        m.volume = key();
        m.claim_id = Some("lock-9".into());
        c.restore([&m], t0);
        assert!(matches!(
            &c.orders()[..],
            [Effect::RenewClaim { lock_id, at_once: true, .. }] if lock_id == "lock-9"
        ));
    }

    /// A claim restored after a restart on the same boot gets its lease back from the
    /// renewals kept on disk: its first renewal failing fences it a margin before that lease
    /// ends, not at once. A lease whose fence moment has passed, or another lock's, is not
    /// restored (fenced at the first failed renewal, as without the file).
    #[test]
    fn a_restored_lease_defers_the_fence_of_a_failed_first_renewal() {
        let s = Duration::from_secs;
        let t0 = Instant::now() + s(100);
        let restored = |age: u64, lock: &str| {
            let mut c = claims();
            let mut m =
                crate::node::journal::tests::rec(crate::node::journal::MountState::Published);
            m.volume = key();
            m.claim_id = Some("lock-9".into());
            c.restore([&m], t0);
            let ages = BTreeMap::from([(key(), (lock.to_string(), s(age)))]);
            let back = c.restore_leases(&ages, t0);
            let failed = Err(ClaimError::Nomad {
                volume: key(),
                source: crate::nomad::NomadError::Status {
                    what: "lock-renew".into(),
                    status: 0,
                    body: "unreachable".into(),
                },
            });
            c.on_renewed(&key(), "lock-9", t0, failed, true, t0 + s(1));
            (c, back)
        };
        // Sent 5 s before the restart: lease end t0 + 40, fence at t0 + 25.
        let (mut c, back) = restored(5, "lock-9");
        assert_eq!(back, vec![(key(), "lock-9".to_string(), t0 - s(5))]);
        assert_eq!(c.lease_end(&key()), Some(t0 + s(40)));
        assert!(
            c.fences_due(t0 + s(24)).is_empty(),
            "fenced before its lease's margin"
        );
        assert_eq!(c.fences_due(t0 + s(25)), vec![key()]);
        // Sent 31 s before: its fence moment (t0 - 1) has passed: unknown, fenced at once.
        let (mut c, back) = restored(31, "lock-9");
        assert!(back.is_empty());
        assert_eq!(c.fences_due(t0 + s(1)), vec![key()]);
        // Another lock's renewal says nothing of this claim's lease.
        let (mut c, back) = restored(1, "lock-8");
        assert!(back.is_empty());
        assert_eq!(c.fences_due(t0 + s(1)), vec![key()]);
    }

    /// The lease runs from when the call was *sent*: 2 x TTL + lock delay after an acquire
    /// and after each renewal (Nomad re-arms the timer with 2 x TTL on both).
    /// The fence comes a margin (15 s here) before the lease ends.
    #[test]
    fn the_lease_runs_from_the_sent_call_and_the_fence_comes_a_margin_before_its_end() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut c = claims();
        let mut r = Retries::new(1);
        c.acquire_sent(&key(), t0);
        // Answered 3 s later: the lease still runs from t0.
        c.on_acquired(key(), Ok("lock-1".into()), &mut r, t0 + s(3));
        assert_eq!(c.lease_end(&key()), Some(t0 + s(45)));
        assert!(c.fences_due(t0 + s(29)).is_empty());
        // A renewal sent at t0 + 8 and answered at t0 + 12: 2 x TTL + lock delay from t0 + 8.
        assert_eq!(
            c.on_renewed(&key(), "lock-1", t0 + s(8), Ok(()), true, t0 + s(12)),
            Renewal::Kept
        );
        assert_eq!(
            c.lease_end(&key()),
            Some(t0 + s(53)),
            "a renewal re-arms the lock's timer: the lease runs from its sending"
        );
        c.on_renewed(&key(), "lock-1", t0 + s(17), Ok(()), true, t0 + s(17));
        assert_eq!(c.lease_end(&key()), Some(t0 + s(62)));
        // No renewal succeeds any more: fenced at lease end - margin = t0 + 47.
        assert_eq!(c.next_wakeup(), Some(t0 + s(47)));
        assert!(c.fences_due(t0 + s(46)).is_empty());
        assert_eq!(c.fences_due(t0 + s(47)), vec![key()]);
        assert_eq!(c.states()[&key()], ClaimState::Fenced);
        assert!(c.fences_due(t0 + s(55)).is_empty(), "fenced once");
        assert_eq!(c.status()["default/db"], "fenced");
    }

    /// A fenced claim keeps being renewed: a renewal that succeeds restores it, one that
    /// finds the lock gone loses it.
    #[test]
    fn a_fenced_claim_is_restored_by_a_renewal_or_lost_when_the_lock_is_gone() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        for lost in [false, true] {
            let mut c = claims();
            held(&mut c, t0);
            let nomad = || ClaimError::Nomad {
                volume: key(),
                source: crate::nomad::NomadError::Status {
                    what: "lock-renew".into(),
                    status: 500,
                    body: "rpc error: failed to get conn: dial tcp: i/o timeout".into(),
                },
            };
            assert_eq!(
                c.on_renewed(&key(), "lock-1", t0 + s(5), Err(nomad()), true, t0 + s(15)),
                Renewal::Kept
            );
            assert_eq!(c.fences_due(t0 + s(30)), vec![key()]);
            assert!(
                !c.orders()
                    .iter()
                    .any(|o| matches!(o, Effect::StopRenewing { .. })),
                "renewals go on while fenced"
            );
            let result = if lost {
                Err(ClaimError::Lost { volume: key() })
            } else {
                Ok(())
            };
            let r = c.on_renewed(&key(), "lock-1", t0 + s(30), result, true, t0 + s(31));
            if lost {
                assert_eq!(r, Renewal::Lost);
                assert_eq!(c.states()[&key()], ClaimState::Lost);
            } else {
                assert_eq!(r, Renewal::Restored);
                assert_eq!(c.states()[&key()], ClaimState::Held);
                assert_eq!(c.lease_end(&key()), Some(t0 + s(75)));
            }
        }
    }

    /// An agent paused past its fence moment (SIGSTOP) finds the fence due on its first
    /// pass, whatever it was doing before.
    #[test]
    fn a_paused_agent_finds_the_fence_due_at_once() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        // Paused with the renewal in flight; resumed a minute later.
        assert_eq!(c.fences_due(t0 + Duration::from_secs(65)), vec![key()]);
    }

    /// The lease counts a VM suspend (issue 31): a lease with 40 s left, then a 60 s suspend.
    /// On the monotonic clock the resumed agent would see 40 s left and go on writing; on the
    /// agent's clock (`CLOCK_BOOTTIME`, [`crate::node::clock::BootClock`]) the fence is due at
    /// the first pass.
    #[test]
    fn a_vm_suspend_counts_in_the_lease() {
        use crate::node::clock::{BootClock, SuspendSource};
        struct Fake(std::sync::Mutex<Duration>);
        impl SuspendSource for Fake {
            fn gap(&self) -> Option<Duration> {
                Some(*self.0.lock().unwrap())
            }
        }
        let s = Duration::from_secs;
        let fake = std::sync::Arc::new(Fake(std::sync::Mutex::new(s(3))));
        let clock = BootClock::new(fake.clone());
        let mono = Instant::now();
        let mut c = claims();
        held(&mut c, clock.at(mono));
        // Suspended with the renewal in flight for 60 s; resumed 1 s (monotonic) later.
        *fake.0.lock().unwrap() = s(63);
        assert_eq!(
            c.fences_due(clock.at(mono + s(6))),
            vec![key()],
            "the suspend counts: the fence is due on resume"
        );
    }

    /// After a restart the lease's end is unknown: no fence while the first renewal is in
    /// flight, a fence at once when it fails, none when it succeeds.
    #[test]
    fn a_restored_claim_is_fenced_when_its_first_renewal_fails() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let mut m = crate::node::journal::tests::rec(crate::node::journal::MountState::Published);
        m.volume = key();
        m.claim_id = Some("lock-9".into());
        for ok in [true, false] {
            let mut c = claims();
            c.restore([&m], t0);
            assert_eq!(c.orders().len(), 1);
            assert!(c.fences_due(t0 + Duration::from_secs(1)).is_empty());
            let result = if ok {
                Ok(())
            } else {
                Err(ClaimError::Nomad {
                    volume: key(),
                    source: crate::nomad::NomadError::Status {
                        what: "lock-renew".into(),
                        status: 500,
                        body: "No cluster leader".into(),
                    },
                })
            };
            let at = t0 + Duration::from_secs(2);
            c.on_renewed(&key(), "lock-9", t0, result, true, at);
            assert_eq!(c.fences_due(at) == vec![key()], !ok, "ok = {ok}");
        }
    }
}
