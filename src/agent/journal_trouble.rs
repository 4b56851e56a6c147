//! A journal that cannot be written (the state disk is full, read-only or failing): a
//! reported condition, not a spiral. The core stops starting work that needs a durable
//! intent (publishes and unpublishes), keeps what is published (its health probes and
//! claims go on), tries the write again at a steady pace and resumes by itself once a
//! write succeeds. The log gets one line when writes start failing, at most one per
//! [`LOG_EVERY`] while they keep failing, and one when they succeed again.

use crate::volume::VolumeKey;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long after a failed write the next one is tried (the state is written whole then).
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);
/// At most one log line per this interval while writes keep failing.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);

/// Writes failing since a first failure.
#[derive(Debug, Clone)]
struct Failing {
    since: Instant,
    /// Unix seconds of the first failure (for the status).
    since_secs: u64,
    error: String,
    failures: u64,
    next_try: Instant,
    last_logged: Instant,
}

/// Whether the journal can be written, as the last write said.
#[derive(Debug, Default)]
pub(crate) struct JournalTrouble {
    failing: Option<Failing>,
    /// The volumes whose last error is this trouble's, with the error they were given:
    /// cleared when writes succeed again ([`JournalTrouble::succeeded`]).
    blamed: BTreeMap<VolumeKey, String>,
}

impl JournalTrouble {
    /// A write failed at `now` with `error`.
    pub(crate) fn failed(&mut self, error: &str, now: Instant) {
        match &mut self.failing {
            None => {
                tracing::error!(error, retry_after_ms = RETRY_AFTER.as_millis() as u64, "journal write failed: new publishes and unpublishes wait until the state directory can be written again (published volumes stay); free space on the state directory's filesystem");
                self.failing = Some(Failing {
                    since: now,
                    since_secs: crate::node::journal::now_secs(),
                    error: error.to_string(),
                    failures: 1,
                    next_try: now + RETRY_AFTER,
                    last_logged: now,
                });
            }
            Some(f) => {
                f.failures += 1;
                f.error = error.to_string();
                f.next_try = now + RETRY_AFTER;
                if now.saturating_duration_since(f.last_logged) >= LOG_EVERY {
                    f.last_logged = now;
                    tracing::error!(
                        error,
                        failures = f.failures,
                        failing_for_s = now.saturating_duration_since(f.since).as_secs(),
                        "journal writes still failing: new publishes and unpublishes still wait"
                    );
                }
            }
        }
    }

    /// Notes that `volume`'s last error is now `error`, given for this trouble.
    pub(crate) fn blame(&mut self, volume: &VolumeKey, error: &str) {
        self.blamed.insert(volume.clone(), error.to_string());
    }

    /// The refusal ([`JournalTrouble::refusal`]) for a step of `volume`, noted as its last
    /// error ([`JournalTrouble::blame`]); `None` while writes succeed.
    pub(crate) fn refuse(&mut self, volume: &VolumeKey) -> Option<String> {
        let why = self.refusal()?;
        self.blame(volume, &why);
        Some(why)
    }

    /// A write succeeded at `now`: when it ends a failing period, the errors this trouble
    /// gave, by volume (each still the volume's last error unless another replaced it since).
    pub(crate) fn succeeded(&mut self, now: Instant) -> Option<BTreeMap<VolumeKey, String>> {
        let f = self.failing.take()?;
        tracing::warn!(
            failures = f.failures,
            failed_for_ms = now.saturating_duration_since(f.since).as_millis() as u64,
            "journal writes succeed again: new publishes and unpublishes resume"
        );
        Some(std::mem::take(&mut self.blamed))
    }

    /// True while writes fail: no new work that needs a durable intent starts.
    #[cfg(test)]
    pub(crate) fn is_failing(&self) -> bool {
        self.failing.is_some()
    }

    /// The error that new work is refused with, while writes fail.
    pub(crate) fn refusal(&self) -> Option<String> {
        self.failing.as_ref().map(|f| {
            format!(
                "the agent's state journal cannot be written ({}); new publishes and unpublishes wait until it can (free space on the state directory's filesystem; the agent resumes by itself)",
                f.error
            )
        })
    }

    /// False until the next write may be tried (`now` is before the retry time).
    pub(crate) fn may_write(&self, now: Instant) -> bool {
        self.failing.as_ref().is_none_or(|f| now >= f.next_try)
    }

    /// When the next write is due, while writes fail.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.failing.as_ref().map(|f| f.next_try)
    }

    /// The status entry: `null`, or `{"failing_since": unix s, "error", "failed_writes"}`.
    pub(crate) fn status(&self) -> serde_json::Value {
        match &self.failing {
            None => serde_json::json!({"failing": false}),
            Some(f) => serde_json::json!({
                "failing": true,
                "failing_since": f.since_secs,
                "error": f.error,
                "failed_writes": f.failures,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_then_paced_then_resumed() {
        let t = Instant::now();
        let mut j = JournalTrouble::default();
        assert!(j.may_write(t) && !j.is_failing());
        j.failed("No space left on device", t);
        assert!(j.is_failing());
        assert!(!j.may_write(t + Duration::from_millis(10)));
        assert!(j.may_write(t + RETRY_AFTER));
        assert_eq!(j.next_wakeup(), Some(t + RETRY_AFTER));
        j.failed("No space left on device", t + RETRY_AFTER);
        assert_eq!(j.status()["failed_writes"], 2);
        assert!(j.refusal().unwrap().contains("No space left"));
        let v = VolumeKey {
            namespace: "default".into(),
            name: "v".into(),
        };
        let why = j.refuse(&v).unwrap();
        let blamed = j.succeeded(t + RETRY_AFTER * 2).unwrap();
        assert_eq!(blamed.get(&v), Some(&why));
        assert!(!j.is_failing() && j.succeeded(t + RETRY_AFTER * 3).is_none());
        assert!(j.refuse(&v).is_none());
        assert_eq!(j.status()["failing"], false);
    }
}
