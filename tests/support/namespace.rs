//! Mount namespaces that tests make as a task's or a service's: each holds a copy of every
//! mount of the host at the moment it is made, other tests' volumes included, and another
//! test's agent rightly treats such a copy as its volume's holder (an unpublish waits for a
//! private copy; a fence kills whoever holds a copy). Tests that run beside each other (the
//! lanes of `scripts/test-lanes`, the threads of one binary) must not hold each other's
//! volumes: a namespace made here drops every mount under the temporary directory but its
//! own test's before it runs anything.

#![allow(dead_code)]

use std::path::Path;

/// A shell snippet, run first inside a new mount namespace: lazily unmounts (in that
/// namespace only) every mount under the temporary directory that is not under `keep`
/// (the test's own sandbox), deepest first. A slave or private namespace's unmounts do not
/// reach the host. `keep` = `None` drops them all.
pub fn drop_foreign_mounts(keep: Option<&Path>) -> String {
    let tmp = std::env::temp_dir();
    let keep = keep.map(|k| k.display().to_string()).unwrap_or_default();
    format!(
        r#"awk -v tmp='{tmp}/' -v keep='{keep}' 'index($5, tmp) == 1 && (keep == "" || ($5 != keep && index($5, keep "/") != 1)) {{ print $5 }}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done; "#,
        tmp = tmp.display().to_string().trim_end_matches('/'),
    )
}
