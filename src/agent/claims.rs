//! Decides this node's single-node claims ([`crate::cluster::claims`]): when a held claim is renewed
//! (every TTL/3), what a failed acquire means for the caller waiting on the volume, and
//! when a claim is lost ("claim lost": a renewal that finds the lock gone). Whether a
//! claim is taken or given back is the plan's decision ([`crate::agent::reconcile`]); this module
//! keeps the claims' state and timing.

use crate::agent::effect::Effect;
use crate::agent::reconcile::{ClaimState, Waiting};
use crate::agent::retry::{Work, CLAIM_RETRY};
use crate::cluster::claims::{ClaimError, ClaimSettings};
use crate::node::journal::MountRecord;
use crate::retry::Retries;
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// This node's claim on one volume.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    pub id: String,
    pub state: ClaimState,
    pub renewed: Instant,
}

/// Every claim of this node, and why publishes wait for one.
#[derive(Debug)]
pub(crate) struct Claims {
    settings: ClaimSettings,
    held: BTreeMap<VolumeKey, Claim>,
    /// Volumes whose acquire failed, with the reason a waiting caller is told.
    wait: BTreeMap<VolumeKey, String>,
    renewing: BTreeSet<VolumeKey>,
}

impl Claims {
    pub(crate) fn new(settings: ClaimSettings) -> Self {
        Self {
            settings,
            held: BTreeMap::new(),
            wait: BTreeMap::new(),
            renewing: BTreeSet::new(),
        }
    }

    /// Claims recorded in the journal before a restart are renewed at once: a failed renew
    /// means another node may have the volume now, and the mount here is removed first.
    pub(crate) fn restore<'a>(
        &mut self,
        mounts: impl IntoIterator<Item = &'a MountRecord>,
        now: Instant,
    ) {
        let stale = now.checked_sub(self.settings.ttl).unwrap_or(now);
        for m in mounts {
            if let Some(id) = &m.claim_id {
                self.held.insert(
                    m.volume.clone(),
                    Claim {
                        id: id.clone(),
                        state: ClaimState::Held,
                        renewed: stale,
                    },
                );
            }
        }
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

    fn every(&self) -> std::time::Duration {
        self.settings.ttl / 3
    }

    /// Renewals due at `now`: held claims renewed a third of the TTL ago or more.
    pub(crate) fn renewals(&mut self, now: Instant) -> Vec<Effect> {
        let every = self.every();
        let due: Vec<(VolumeKey, String)> = self
            .held
            .iter()
            .filter(|(k, c)| {
                c.state == ClaimState::Held
                    && now.saturating_duration_since(c.renewed) >= every
                    && !self.renewing.contains(*k)
            })
            .map(|(k, c)| (k.clone(), c.id.clone()))
            .collect();
        due.into_iter()
            .map(|(volume, lock_id)| {
                self.renewing.insert(volume.clone());
                Effect::RenewClaim { volume, lock_id }
            })
            .collect()
    }

    /// When the next renewal is due.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.held
            .iter()
            .filter(|(k, c)| c.state == ClaimState::Held && !self.renewing.contains(*k))
            .map(|(_, c)| c.renewed + self.every())
            .min()
    }

    /// An acquire finished. A failure keeps the volume waiting, with the reason a caller
    /// is told, and retries soon (claims are retried faster than plugin calls: the holder
    /// may let go any moment).
    pub(crate) fn on_acquired(
        &mut self,
        volume: VolumeKey,
        result: Result<String, ClaimError>,
        retries: &mut Retries<Work>,
        now: Instant,
    ) {
        match result {
            Ok(id) => {
                tracing::info!(%volume, "claim acquired");
                self.wait.remove(&volume);
                retries.succeeded(&Work::Claim(volume.clone()));
                self.held.insert(
                    volume,
                    Claim {
                        id,
                        state: ClaimState::Held,
                        renewed: now,
                    },
                );
            }
            Err(e) => {
                let reason = match &e {
                    ClaimError::Held { .. } => format!(
                        "publish waits for the single-node claim: {e}. A single-node volume is used on one node at a time: this allocation starts once the holder's allocations using it stop (the claim is released after their unpublish, or lapses about 2 x --claim-ttl + --claim-lock-delay after its node goes silent). A canary or a rolling update placed on another node waits until the old allocation stops, which with canaries is only after promotion: for such a volume the job author can use `update {{ canary = 0, max_parallel = 1 }}` (the old allocation stops first), keep the group on the holder's node (a constraint on the node), or use a multi-node access mode; and the prestart task's timeout must cover the hand-over"
                    ),
                    _ => format!("cannot take the claim: {e}"),
                };
                if self.wait.get(&volume) != Some(&reason) {
                    tracing::info!(%volume, reason = %e, "publish waits for the claim");
                }
                retries.failed(&Work::Claim(volume.clone()), CLAIM_RETRY, now);
                self.wait.insert(volume, reason);
            }
        }
    }

    /// A renewal finished. "Claim lost": the lock is gone (expired or taken over), so
    /// another node may use the volume now; the plan unpublishes it here before anything
    /// else. Any other failure is retried at the next renewal time.
    pub(crate) fn on_renewed(
        &mut self,
        volume: &VolumeKey,
        result: Result<(), ClaimError>,
        mounted_here: bool,
        now: Instant,
    ) {
        self.renewing.remove(volume);
        match result {
            Ok(()) => {
                if let Some(c) = self.held.get_mut(volume) {
                    c.renewed = now;
                }
            }
            Err(e @ ClaimError::Lost { .. }) => {
                tracing::warn!(%volume, reason = %e, "claim lost: another node may use the volume now; unpublishing here before anything else");
                if let Some(c) = self.held.get_mut(volume) {
                    c.state = ClaimState::Lost;
                }
                if !mounted_here {
                    self.held.remove(volume);
                }
            }
            Err(e) => {
                tracing::warn!(%volume, error = %e, "claim renewal failed; retrying");
                let back = self.every() / 2;
                if let Some(c) = self.held.get_mut(volume) {
                    // Try again after half a renewal period.
                    c.renewed = now.checked_sub(back).unwrap_or(now);
                }
            }
        }
    }

    /// The volume was unpublished here: a lost claim is forgotten (a held one is given
    /// back by the plan, unless an allocation here still needs the volume).
    pub(crate) fn on_unpublished(&mut self, volume: &VolumeKey) {
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
        if let Err(e) = result {
            tracing::warn!(%volume, error = %e, "claim release failed; it expires with its TTL");
        }
        self.held.remove(volume);
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

    /// For `dhv-binder status`: volume → "held" / "lost".
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
        })
    }

    fn held(c: &mut Claims, now: Instant) {
        let mut r = Retries::new(1);
        c.on_acquired(key(), Ok("lock-1".into()), &mut r, now);
    }

    #[test]
    fn a_held_claim_is_renewed_every_third_of_its_ttl() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        assert!(c.renewals(t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(c.next_wakeup(), Some(t0 + Duration::from_secs(5)));
        let due = c.renewals(t0 + Duration::from_secs(5));
        assert!(matches!(&due[..], [Effect::RenewClaim { lock_id, .. }] if lock_id == "lock-1"));
        assert!(
            c.renewals(t0 + Duration::from_secs(6)).is_empty(),
            "one renewal in flight at a time"
        );
        c.on_renewed(&key(), Ok(()), true, t0 + Duration::from_secs(6));
        assert_eq!(c.next_wakeup(), Some(t0 + Duration::from_secs(11)));
    }

    #[test]
    fn a_renewal_that_finds_the_lock_gone_loses_the_claim() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        c.renewals(t0 + Duration::from_secs(5));
        c.on_renewed(
            &key(),
            Err(ClaimError::Lost { volume: key() }),
            true,
            t0 + Duration::from_secs(5),
        );
        assert_eq!(c.states()[&key()], ClaimState::Lost);
        assert!(
            c.renewals(t0 + Duration::from_secs(60)).is_empty(),
            "a lost claim is not renewed"
        );
        c.on_unpublished(&key());
        assert!(c.states().is_empty(), "forgotten once unpublished");
    }

    #[test]
    fn a_lost_claim_with_nothing_mounted_is_forgotten_at_once() {
        let t0 = Instant::now();
        let mut c = claims();
        held(&mut c, t0);
        c.renewals(t0 + Duration::from_secs(5));
        c.on_renewed(&key(), Err(ClaimError::Lost { volume: key() }), false, t0);
        assert!(c.states().is_empty());
    }

    #[test]
    fn a_claim_held_elsewhere_makes_the_publish_wait_and_retries_soon() {
        let t0 = Instant::now();
        let mut c = claims();
        let mut r = Retries::new(1);
        let err = ClaimError::Held {
            volume: key(),
            holder: "node-2".into(),
        };
        c.on_acquired(key(), Err(err), &mut r, t0);
        let w: Vec<Waiting> = c.waiting().collect();
        assert!(
            w[0].reason
                .contains("publish waits for the single-node claim"),
            "{w:?}"
        );
        // Issue 11 #8: it says why it waits and what the job author can change.
        for says in [
            "held by node-2",
            "canary",
            "update {",
            "multi-node",
            "timeout",
        ] {
            assert!(w[0].reason.contains(says), "{says:?} missing: {w:?}");
        }
        assert!(!r.ready(&Work::Claim(key()), t0));
        assert!(r.ready(&Work::Claim(key()), t0 + Duration::from_millis(600)));
        held(&mut c, t0);
        assert_eq!(c.waiting().count(), 0);
    }

    #[test]
    fn claims_from_the_journal_are_renewed_at_once_after_a_restart() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let mut c = claims();
        let mut m = crate::node::journal::tests::rec(crate::node::journal::MountState::Published);
        m.volume = key();
        m.claim_id = Some("lock-9".into());
        c.restore([&m], t0);
        assert!(
            matches!(&c.renewals(t0)[..], [Effect::RenewClaim { lock_id, .. }] if lock_id == "lock-9")
        );
    }
}
