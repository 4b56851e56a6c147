//! The kit's report: one verdict per rule with its evidence, which rules the run was asked
//! to run (`-rule`) or told do not apply (`-skip`), the summary and the deferred verdict.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Every rule, in the order the kit runs them: the names `-rule` and `-skip` take.
pub const RULES: &[&str] = &[
    "fingerprint",
    "deferred_bind",
    "capabilities",
    "placement fields",
    "JSON input parsed",
    "create x10",
    "publish x10",
    "owner and mode",
    "unpublish x10",
    "data kept across publishes",
    "helper outlives the caller",
    "unpublish of nothing",
    "publish to occupied target",
    "read-only publish",
    "mount flags",
    "unpublish while in use",
    "concurrent calls",
    "killed by the timeout",
    "unpublish that cannot flush",
    "snapshot x2",
    "snapshot_list",
    "create from snapshot",
    "snapshot_delete x2",
    "clone",
    "expand",
    "fence",
    "fence x2",
    "fence of nothing",
    "refresh",
    "refresh of nothing",
    "fence_node and unfence_node x2",
    "stats",
    "health",
    "list",
    "foreign signature refused",
    "unclean filesystem checked",
    "paths confined",
    "symlink race",
    "delete x10",
    "delete of nothing",
    "create x10 (Nomad contract)",
    "delete x10 (Nomad contract)",
    "error classes",
    "unknown operation refused",
    "output shape",
    "helpers do not hold the output",
    "within the timeout",
    "nothing left mounted",
];

/// The width of the rule column: the longest name in [`RULES`].
const WIDTH: usize = 30;

/// A rule's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// Not applicable by the plugin's own word: an optional operation it does not declare,
    /// the deferred rules of a plugin that is not deferred.
    Skip,
    /// The rule could not run with what the kit was given (no parameter naming the storage
    /// directory, no uid/gid/mode, no URL to cut): a failure of the run, printed `FAIL`.
    NotRun,
    /// The author said it does not apply (`-skip RULE`).
    Waived,
}

/// One rule's result.
#[derive(Debug, Clone)]
pub struct RuleResult {
    pub rule: &'static str,
    pub verdict: Verdict,
    pub evidence: String,
}

/// The whole report.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub plugin: PathBuf,
    pub deferred: Option<bool>,
    pub rules: Vec<RuleResult>,
    /// Call durations per operation (milliseconds), for the timing summary.
    pub timings: BTreeMap<&'static str, Vec<u64>>,
    /// The rules asked for with `-rule` (empty: every rule).
    pub only: Vec<String>,
    /// The rules the author said do not apply (`-skip`).
    pub waived: BTreeSet<String>,
}

impl Report {
    /// True when no rule failed or could not run.
    pub fn passed(&self) -> bool {
        self.rules
            .iter()
            .all(|r| !matches!(r.verdict, Verdict::Fail | Verdict::NotRun))
    }

    /// True when the run is asked for `rule` (every rule without `-rule`), and not told it
    /// does not apply.
    pub fn wants(&self, rule: &str) -> bool {
        !self.waived.contains(rule) && (self.only.is_empty() || self.only.iter().any(|r| r == rule))
    }

    /// Records `rule`'s verdict: a rule waived by `-skip` is recorded as waived (once); with
    /// `-rule`, a rule not asked for is left out unless it failed (a step the asked rule
    /// needs, or a call the whole-run rules saw go wrong).
    fn record(&mut self, rule: &'static str, verdict: Verdict, evidence: String) {
        if self.waived.contains(rule) {
            if !self.rules.iter().any(|r| r.rule == rule) {
                self.rules.push(RuleResult {
                    rule,
                    verdict: Verdict::Waived,
                    evidence: "-skip: the plugin's author says it does not apply".into(),
                });
            }
            return;
        }
        let asked = self.only.is_empty() || self.only.iter().any(|r| r == rule);
        if !asked && verdict != Verdict::Fail {
            return;
        }
        self.rules.push(RuleResult {
            rule,
            verdict,
            evidence,
        });
    }

    pub(super) fn push(&mut self, rule: &'static str, ok: bool, evidence: impl Into<String>) {
        let v = if ok { Verdict::Pass } else { Verdict::Fail };
        self.record(rule, v, evidence.into());
    }

    /// Not applicable by the plugin's own word (see [`Verdict::Skip`]).
    pub(super) fn skip(&mut self, rule: &'static str, why: &str) {
        self.record(rule, Verdict::Skip, why.into());
    }

    /// The rule cannot run with what the kit was given: `why` says what it needs.
    pub(super) fn not_run(&mut self, rule: &'static str, why: &str) {
        self.record(
            rule,
            Verdict::NotRun,
            format!("not run: {why}; or `-skip '{rule}'` if it does not apply to this plugin"),
        );
    }

    /// Rows for the waived rules the run never reached (e.g. after a failed create).
    pub(super) fn finish(&mut self) {
        let waived: Vec<&'static str> = RULES
            .iter()
            .copied()
            .filter(|r| self.waived.contains(*r))
            .collect();
        for r in waived {
            self.record(r, Verdict::Waived, String::new());
        }
        // In the order of [`RULES`] (the table of docs/plugin-protocol.md), waived rules too.
        self.rules.sort_by_key(|r| {
            RULES
                .iter()
                .position(|n| *n == r.rule)
                .unwrap_or(RULES.len())
        });
    }

    fn names(&self, v: Verdict) -> Vec<&'static str> {
        self.rules
            .iter()
            .filter(|r| r.verdict == v)
            .map(|r| r.rule)
            .collect()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "dhv-binder plugin check: {}", self.plugin.display())?;
        if !self.only.is_empty() {
            writeln!(
                f,
                "-rule: only {} (and whatever it needs: fingerprint, create, delete)",
                self.only.join(", ")
            )?;
        }
        for r in &self.rules {
            let v = match r.verdict {
                Verdict::Pass => "PASS",
                Verdict::Fail | Verdict::NotRun => "FAIL",
                Verdict::Skip | Verdict::Waived => "SKIP",
            };
            writeln!(f, "{v}  {:<WIDTH$} {}", r.rule, r.evidence)?;
        }
        let (failed, not_run, waived) = (
            self.names(Verdict::Fail),
            self.names(Verdict::NotRun),
            self.names(Verdict::Waived),
        );
        let skipped = self.names(Verdict::Skip);
        write!(
            f,
            "{} rule{}: {} passed, {} failed, {} skipped",
            self.rules.len(),
            if self.rules.len() == 1 { "" } else { "s" },
            self.names(Verdict::Pass).len(),
            failed.len() + not_run.len(),
            skipped.len() + waived.len(),
        )?;
        if !not_run.is_empty() {
            write!(f, "; could not run: {}", not_run.join(", "))?;
        }
        if !waived.is_empty() {
            write!(f, "; skipped by -skip: {}", waived.join(", "))?;
        }
        writeln!(f)?;
        match self.deferred {
            Some(true) if !self.only.is_empty() => writeln!(
                f,
                "deferred: declared; not judged (only -rule {} ran: run the whole kit to judge it)",
                self.only.join(", ")
            ),
            Some(true) if failed.is_empty() && not_run.is_empty() => {
                write!(f, "deferred: yes (every rule run passed")?;
                if !waived.is_empty() {
                    write!(f, "; not run by -skip: {}", waived.join(", "))?;
                }
                writeln!(f, "): dhv-binder can publish and unpublish it")
            }
            Some(true) => writeln!(
                f,
                "deferred: declared, but NOT conforming: {} did not pass; do not deploy it for dhv-binder until they do",
                failed
                    .iter()
                    .chain(&not_run)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some(false) => writeln!(
                f,
                "deferred: NO. A plain Nomad DHV plugin: dhv-binder lists it as not deferred and never uses it"
            ),
            None => writeln!(f, "deferred: unknown (fingerprint failed)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            plugin: "/p/bind".into(),
            deferred: Some(true),
            ..Default::default()
        }
    }

    #[test]
    fn the_rule_column_fits_the_longest_name() {
        assert_eq!(RULES.iter().map(|r| r.len()).max(), Some(WIDTH));
    }

    #[test]
    fn a_rule_that_cannot_run_fails_the_run_and_deferred_yes_needs_every_rule_passed() {
        let mut r = report();
        r.push("fingerprint", true, "ok");
        r.not_run("paths confined", "no --param names the storage directory");
        assert!(!r.passed());
        let text = r.to_string();
        assert!(
            text.contains("FAIL  paths confined                 not run: no --param names the storage directory; or `-skip 'paths confined'` if it does not apply to this plugin"),
            "{text}"
        );
        assert!(
            text.contains("2 rules: 1 passed, 1 failed, 0 skipped; could not run: paths confined"),
            "{text}"
        );
        assert!(
            text.contains("deferred: declared, but NOT conforming: paths confined did not pass"),
            "{text}"
        );
        assert!(!text.contains("deferred: yes"), "{text}");
    }

    #[test]
    fn a_rule_skipped_by_the_author_is_shown_in_the_summary_and_passes() {
        let mut r = report();
        r.waived.insert("paths confined".into());
        r.push("fingerprint", true, "ok");
        r.not_run("paths confined", "no path");
        r.finish();
        assert!(r.passed());
        let text = r.to_string();
        assert!(
            text.contains("SKIP  paths confined                 -skip: the plugin's author says it does not apply"),
            "{text}"
        );
        assert!(
            text.contains(
                "2 rules: 1 passed, 0 failed, 1 skipped; skipped by -skip: paths confined"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "deferred: yes (every rule run passed; not run by -skip: paths confined)"
            ),
            "{text}"
        );
    }

    #[test]
    fn with_rule_only_the_asked_rule_and_failures_are_reported_and_deferred_is_not_judged() {
        let mut r = report();
        r.only = vec!["symlink race".into()];
        assert!(r.wants("symlink race") && !r.wants("concurrent calls"));
        r.push("fingerprint", true, "ok");
        r.skip("clone", "not declared");
        r.push("create x10", false, "call 1: boom");
        r.push("symlink race", true, "nothing escaped");
        let text = r.to_string();
        assert!(!text.contains("PASS  fingerprint"), "{text}");
        assert!(!text.contains("clone"), "{text}");
        assert!(text.contains("FAIL  create x10"), "{text}");
        assert!(text.contains("PASS  symlink race"), "{text}");
        assert!(text.contains("deferred: declared; not judged"), "{text}");
    }
}
