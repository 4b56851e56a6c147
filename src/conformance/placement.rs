//! The kit's placement rules (docs/plugin-protocol.md, "Attach limits", "Topology",
//! "Error classes"): the fingerprint's `max_volumes` and `topology` have the shapes the
//! agent accepts, and no publish the kit makes fails with the class "final" (the kit's
//! volume is not broken; "final" makes every node of a cluster stop offering a volume, so a
//! plugin must keep it for a volume that is broken for everyone).

use super::Kit;
use crate::storage::error_class::ErrorClass;

/// "placement fields": `max_volumes` a whole number from 1 to 2^32-1, `topology` an object
/// of string segments the agent accepts ([`crate::volume::topology::check_segments`]);
/// skipped when the fingerprint has neither.
pub(super) fn fields_rule(kit: &mut Kit, fp: &serde_json::Value) {
    let rule = "placement fields";
    if !kit.report.wants(rule) {
        return;
    }
    let (max, topo) = (fp.get("max_volumes"), fp.get("topology"));
    if max.is_none() && topo.is_none() {
        kit.report.skip(
            rule,
            "declares neither max_volumes nor topology (unlimited, reachable from anywhere)",
        );
        return;
    }
    let mut said = Vec::new();
    let mut bad = Vec::new();
    match max.map(|m| m.as_u64().filter(|n| (1..=u64::from(u32::MAX)).contains(n))) {
        None => {}
        Some(Some(n)) => said.push(format!("max_volumes {n}")),
        Some(None) => bad.push(format!(
            "\"max_volumes\" must be a whole number from 1 to {}, got {}",
            u32::MAX,
            max.map(|m| m.to_string()).unwrap_or_default()
        )),
    }
    if let Some(t) = topo {
        match serde_json::from_value::<crate::volume::topology::Segments>(t.clone()) {
            Err(e) => bad.push(format!(
                "\"topology\" must map segment names to strings: {e}"
            )),
            Ok(s) => match crate::volume::topology::check_segments(&s) {
                Ok(()) => said.push(format!("topology {}", crate::volume::topology::show(&s))),
                Err(e) => bad.push(format!("\"topology\": {e}")),
            },
        }
    }
    if bad.is_empty() {
        kit.report.push(rule, true, said.join("; "));
    } else {
        kit.report.push(rule, false, bad.join("; "));
    }
}

/// "error classes": every failed publish of the run (an occupied target, calls killed by
/// the timeout, concurrent calls: all failures of this node, never of the volume) is
/// classed "retry-here" or "elsewhere", never "final".
pub(super) fn classes_rule(kit: &mut Kit) {
    let rule = "error classes";
    if !kit.report.wants(rule) {
        return;
    }
    let finals: Vec<&String> = kit
        .publish_failures
        .iter()
        .filter(|(c, _)| *c == ErrorClass::Final)
        .map(|(_, s)| s)
        .collect();
    let mut seen: Vec<&str> = kit
        .publish_failures
        .iter()
        .map(|(c, _)| c.as_str())
        .collect();
    seen.sort_unstable();
    seen.dedup();
    if finals.is_empty() {
        kit.report.push(
            rule,
            true,
            format!(
                "{} failed publishes, classed {}",
                kit.publish_failures.len(),
                if seen.is_empty() {
                    "(none)".to_string()
                } else {
                    seen.join(", ")
                }
            ),
        );
    } else {
        kit.report.push(
            rule,
            false,
            format!(
                "a publish of the kit's healthy volume failed with the class \"final\" (exit 65 or \"error_class\":\"final\"), which makes every node stop offering the volume: {}",
                finals[0]
            ),
        );
    }
}
