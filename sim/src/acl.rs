//! ACL authorization: who a token is and whether it may do what a request needs.
//!
//! Models `acl/acl.go` (implicit workload-identity variable access
//! `matchingVariablesCapabilitySet`) and `nomad/auth/auth.go` (a JWT signed by the keyring is
//! accepted as a token when its alloc exists and is not client-terminal; policies attached to the
//! job via `JobACL` apply). Off unless `acl { enabled = true }`; `acl { bootstrap_token =
//! "<secret>" }` creates a management token. The tables and policy parsing are
//! [`crate::policy`]; the ACL endpoints are `api::acl`.

use crate::policy::{glob, NamespaceRule, ParsedPolicy};
use crate::state::State;
use crate::store::{Server, StoreError};

/// A capability a request needs.
#[derive(Debug, Clone, Copy)]
pub enum Need<'a> {
    /// `node:read`.
    NodeRead,
    /// `node:write`.
    NodeWrite,
    /// `agent:read`.
    AgentRead,
    /// Management token only.
    Management,
    /// Namespace capability (namespace, capability); namespace `*` = every existing namespace.
    Namespace(&'a str, &'a str),
    /// A namespace capability asked of the wildcard namespace `*` as Nomad's
    /// `acl/acl.go` `AllowNamespaceOperation` answers it: granted when **any** namespace rule
    /// of the token's policies (exact or glob, merged per name, `deny` winning) grants it,
    /// whichever namespaces exist (`anyNamespaceAllowsOp`). `nomad/host_volume_endpoint.go`
    /// `HostVolume.List` checks only this for `namespace=*`, and then filters nothing by
    /// namespace.
    AnyNamespace(&'a str),
    /// Variable capability (namespace, path, read|write|list|destroy).
    Variable(&'a str, &'a str, &'a str),
}

/// Who a request is.
#[derive(Clone)]
enum Identity {
    Management,
    Policies(Vec<ParsedPolicy>, Option<(String, String, String, String)>),
}

fn resolve(st: &State, server: &Server, token: Option<&str>) -> Result<Identity, StoreError> {
    let acl = &st.acl;
    let Some(tok) = token.filter(|t| !t.is_empty()) else {
        let anon = acl
            .policies
            .get("anonymous")
            .map(|p| vec![p.parsed.clone()])
            .unwrap_or_default();
        return Ok(Identity::Policies(anon, None));
    };
    if acl.management.iter().any(|m| m == tok) {
        return Ok(Identity::Management);
    }
    if let Some(t) = acl.tokens.get(tok) {
        if t.management {
            return Ok(Identity::Management);
        }
        let pols = t
            .policies
            .iter()
            .filter_map(|n| acl.policies.get(n))
            .map(|p| p.parsed.clone())
            .collect();
        return Ok(Identity::Policies(pols, None));
    }
    if tok.matches('.').count() == 2 {
        let claims = server
            .keyring
            .verify(tok)
            .map_err(|_| StoreError::Forbidden)?;
        let alloc = st
            .allocs
            .get(&claims.nomad_allocation_id)
            .ok_or(StoreError::Forbidden)?;
        if alloc.client_terminal() {
            return Err(StoreError::Forbidden);
        }
        let group = alloc.TaskGroup.clone();
        let wi = (
            claims.nomad_namespace.clone(),
            claims.nomad_job_id.clone(),
            group.clone(),
            claims.nomad_task.clone(),
        );
        let pols = acl
            .policies
            .values()
            .filter(|p| {
                p.job_acl.as_ref().is_some_and(|(ns, job, g, t)| {
                    ns == &wi.0
                        && job == &wi.1
                        && (g.is_empty() || g == &wi.2)
                        && (t.is_empty() || t == &wi.3)
                })
            })
            .map(|p| p.parsed.clone())
            .collect();
        return Ok(Identity::Policies(pols, Some(wi)));
    }
    Err(StoreError::Forbidden)
}

/// The rule for a namespace: exact match wins, else the longest matching glob.
fn ns_rule<'a>(p: &'a ParsedPolicy, ns: &str) -> Option<&'a NamespaceRule> {
    if let Some((_, r)) = p.namespaces.iter().find(|(n, _)| n == ns) {
        return Some(r);
    }
    p.namespaces
        .iter()
        .filter(|(n, _)| glob(n, ns))
        .max_by_key(|(n, _)| n.len())
        .map(|(_, r)| r)
}

fn ns_allows(pols: &[ParsedPolicy], ns: &str, cap: &str) -> bool {
    let rules: Vec<&NamespaceRule> = pols.iter().filter_map(|p| ns_rule(p, ns)).collect();
    if rules
        .iter()
        .any(|r| r.capabilities.iter().any(|c| c == "deny"))
    {
        return false;
    }
    rules
        .iter()
        .any(|r| r.capabilities.iter().any(|c| c == cap))
}

/// Nomad's `anyNamespaceAllowsOp` (`acl/acl.go`): the rules of one namespace name are merged
/// across policies (`NewACL`: `deny` clears the set), and the capability is granted when
/// any name's merged set holds it.
fn any_ns_allows(pols: &[ParsedPolicy], cap: &str) -> bool {
    let names: std::collections::BTreeSet<&str> = pols
        .iter()
        .flat_map(|p| p.namespaces.iter().map(|(n, _)| n.as_str()))
        .collect();
    names.into_iter().any(|name| {
        let rules: Vec<&NamespaceRule> = pols
            .iter()
            .flat_map(|p| p.namespaces.iter().filter(|(n, _)| n == name))
            .map(|(_, r)| r)
            .collect();
        !rules
            .iter()
            .any(|r| r.capabilities.iter().any(|c| c == "deny"))
            && rules
                .iter()
                .any(|r| r.capabilities.iter().any(|c| c == cap))
    })
}

fn var_allows(pols: &[ParsedPolicy], ns: &str, path: &str, op: &str) -> bool {
    let mut best: Option<(&str, &Vec<String>)> = None;
    for r in pols.iter().filter_map(|p| ns_rule(p, ns)) {
        for (g, caps) in &r.variables {
            if glob(g, path) && best.is_none_or(|(b, _)| g.len() > b.len()) {
                best = Some((g, caps));
            }
        }
    }
    best.is_some_and(|(_, caps)| !caps.iter().any(|c| c == "deny") && caps.iter().any(|c| c == op))
}

fn level_allows(level: &str, write: bool) -> bool {
    match level {
        "write" => true,
        "read" => !write,
        _ => false,
    }
}

/// Authenticates a token whatever the ACL setting (the Task API's `ACL.WhoAmI`): a
/// management or ACL token, or a workload identity of a live allocation; else `Forbidden`.
pub fn authenticate(server: &Server, token: &str) -> Result<(), StoreError> {
    let st = server.read();
    resolve(&st, server, Some(token)).map(|_| ())
}

/// Checks a token against a need. `Forbidden` → 403 "Permission denied".
pub fn check(server: &Server, token: Option<&str>, need: Need<'_>) -> Result<(), StoreError> {
    caller(server, token)?.check(server, need)
}

/// A caller resolved once, when its request starts: Nomad's endpoints call `ResolveACL`
/// before `blockingRPC` and check every wake-up's results against that ACL object (e.g.
/// `nomad/variables_endpoint.go` `List`), so a token deleted while a query blocks neither
/// fails nor empties it; the next request is refused.
#[derive(Clone)]
pub struct Caller(Option<Identity>);

/// Resolves `token` (an unknown one is refused here, before any wait). ACLs disabled: a
/// caller allowed everything.
pub fn caller(server: &Server, token: Option<&str>) -> Result<Caller, StoreError> {
    let st = server.read();
    if !st.acl.enabled {
        return Ok(Caller(None));
    }
    resolve(&st, server, token).map(|i| Caller(Some(i)))
}

impl Caller {
    /// Whether this caller has `need`. `Forbidden` → 403 "Permission denied".
    pub fn check(&self, server: &Server, need: Need<'_>) -> Result<(), StoreError> {
        let (pols, wi) = match &self.0 {
            None | Some(Identity::Management) => return Ok(()),
            Some(Identity::Policies(p, wi)) => (p, wi),
        };
        let ok = match need {
            Need::Management => false,
            Need::NodeRead => pols.iter().any(|p| level_allows(&p.node, false)),
            Need::NodeWrite => pols.iter().any(|p| level_allows(&p.node, true)),
            Need::AgentRead => pols.iter().any(|p| level_allows(&p.agent, false)),
            Need::Namespace("*", cap) => {
                let namespaces: Vec<String> = server.read().namespaces.iter().cloned().collect();
                namespaces.iter().all(|ns| ns_allows(pols, ns, cap))
            }
            Need::Namespace(ns, cap) => ns_allows(pols, ns, cap),
            Need::AnyNamespace(cap) => any_ns_allows(pols, cap),
            Need::Variable(ns, path, op) => {
                let implicit = wi.as_ref().is_some_and(|(wns, job, group, task)| {
                    wns == ns
                        && (op == "read" || op == "list")
                        && [
                            "nomad/jobs".to_string(),
                            format!("nomad/jobs/{job}"),
                            format!("nomad/jobs/{job}/{group}"),
                            format!("nomad/jobs/{job}/{group}/{task}"),
                        ]
                        .iter()
                        .any(|p| p == path)
                });
                implicit || var_allows(pols, ns, path, op)
            }
        };
        if ok {
            Ok(())
        } else {
            Err(StoreError::Forbidden)
        }
    }
}

/// Whether the token may read anything in namespace `ns` (for filtering `namespace=*` lists).
pub fn can_read_ns(server: &Server, token: Option<&str>, ns: &str, cap: &str) -> bool {
    check(server, token, Need::Namespace(ns, cap)).is_ok()
}

/// Event stream topic check (`validateNsOp`, `nomad/event_endpoint.go`).
pub fn check_event_topic(
    server: &Server,
    token: Option<&str>,
    topic: &str,
    ns: &str,
) -> Result<(), StoreError> {
    let need = match topic {
        "Deployment" | "Evaluation" | "Allocation" | "Job" | "Service" | "CSIPlugin" => {
            Need::Namespace(ns, "read-job")
        }
        "HostVolume" => Need::Namespace(ns, "host-volume-read"),
        "CSIVolume" => Need::Namespace(ns, "csi-read-volume"),
        "Node" => Need::NodeRead,
        "Variable" => Need::Variable(ns, "*", "list"),
        _ => Need::Management,
    };
    let r = match need {
        Need::Variable(..) => {
            // Any variable access in the namespace suffices; per-event paths are not filtered here.
            let st = server.read();
            if !st.acl.enabled {
                Ok(())
            } else {
                match resolve(&st, server, token)? {
                    Identity::Management => Ok(()),
                    Identity::Policies(p, wi) => {
                        let any = wi.is_some()
                            || p.iter()
                                .filter_map(|x| ns_rule(x, ns))
                                .any(|r| !r.variables.is_empty());
                        if any {
                            Ok(())
                        } else {
                            Err(StoreError::Forbidden)
                        }
                    }
                }
            }
        }
        n => check(server, token, n),
    };
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_policy;

    #[test]
    fn parses_dhv_binder_policy() {
        let p = parse_policy(
            r#"
namespace "*" {
  capabilities = ["read-job", "host-volume-register", "host-volume-read"]
  variables {
    path "dhv-binder/*" {
      capabilities = ["read", "write", "list", "destroy"]
    }
  }
}
node { policy = "read" }
agent { policy = "read" }
"#,
        )
        .unwrap();
        assert!(ns_allows(std::slice::from_ref(&p), "default", "read-job"));
        assert!(!ns_allows(
            std::slice::from_ref(&p),
            "default",
            "submit-job"
        ));
        assert!(var_allows(
            std::slice::from_ref(&p),
            "prod",
            "dhv-binder/claims/x",
            "write"
        ));
        assert!(!var_allows(
            std::slice::from_ref(&p),
            "prod",
            "other/x",
            "read"
        ));
        assert_eq!(p.node, "read");
        assert!(glob("a*c*e", "abcde"));
        assert!(!glob("a*c", "abd"));
    }
}
