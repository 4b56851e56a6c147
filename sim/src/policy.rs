//! ACL policies and tokens as the server stores them: the tables, policy HCL parsing and
//! namespace policy expansion (`acl/policy.go`), glob matching (`acl/acl.go`). Authorization
//! over these tables is [`crate::acl`]; the HTTP endpoints are `api::acl`.

use crate::hcl_value::{attributes, label, Attrs, HclError};
use serde_json::Value;
use std::collections::BTreeMap;

/// Rules of one `namespace "<glob>"` block.
#[derive(Debug, Default, Clone)]
pub struct NamespaceRule {
    /// Expanded capabilities.
    pub capabilities: Vec<String>,
    /// Variables path glob → capabilities.
    pub variables: Vec<(String, Vec<String>)>,
}

/// A parsed policy.
#[derive(Debug, Default, Clone)]
pub struct ParsedPolicy {
    /// Namespace glob → rule.
    pub namespaces: Vec<(String, NamespaceRule)>,
    /// `node { policy }`.
    pub node: String,
    /// `agent { policy }`.
    pub agent: String,
    /// `operator { policy }`.
    pub operator: String,
}

/// A stored policy (`structs.ACLPolicy`).
#[derive(Debug, Clone)]
pub struct Policy {
    /// Wire JSON.
    pub json: Value,
    /// Parsed rules.
    pub parsed: ParsedPolicy,
    /// `JobACL` binding (namespace, job, group, task), if any.
    pub job_acl: Option<(String, String, String, String)>,
}

/// A token (`structs.ACLToken`).
#[derive(Debug, Clone)]
pub struct Token {
    /// Wire JSON (with SecretID).
    pub json: Value,
    /// management or client.
    pub management: bool,
    /// Attached policy names.
    pub policies: Vec<String>,
}

/// ACL tables and settings.
#[derive(Debug, Default, Clone)]
pub struct AclState {
    /// Whether ACLs are enforced.
    pub enabled: bool,
    /// Management token secrets from config.
    pub management: Vec<String>,
    /// Tokens by secret ID.
    pub tokens: BTreeMap<String, Token>,
    /// Policies by name.
    pub policies: BTreeMap<String, Policy>,
    /// Bootstrap already done.
    pub bootstrapped: bool,
}

/// `*` glob matching (any number of `*`).
pub fn glob(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let mut rest = s;
    for (i, p) in parts.iter().enumerate() {
        if i == 0 {
            if !rest.starts_with(p) {
                return false;
            }
            rest = &rest[p.len()..];
        } else if i == parts.len() - 1 {
            return rest.ends_with(p);
        } else if let Some(pos) = rest.find(p) {
            rest = &rest[pos + p.len()..];
        } else {
            return false;
        }
    }
    true
}

fn expand_ns_policy(policy: &str) -> Vec<&'static str> {
    let read = vec![
        "list-jobs",
        "parse-job",
        "read-job",
        "csi-list-volume",
        "csi-read-volume",
        "read-job-scaling",
        "list-scaling-policies",
        "read-scaling-policy",
        "host-volume-read",
    ];
    match policy {
        "read" => read,
        "write" => {
            let mut w = read;
            w.extend([
                "scale-job",
                "submit-job",
                "dispatch-job",
                "read-logs",
                "read-fs",
                "alloc-exec",
                "alloc-lifecycle",
                "csi-write-volume",
                "csi-mount-volume",
                "submit-recommendation",
                "host-volume-create",
                "host-volume-register",
                "host-volume-write",
                "host-volume-delete",
            ]);
            w
        }
        "scale" => vec![
            "list-scaling-policies",
            "read-scaling-policy",
            "read-job-scaling",
            "scale-job",
        ],
        "deny" => vec!["deny"],
        _ => vec![],
    }
}

/// Parses policy HCL.
pub fn parse_policy(rules: &str) -> Result<ParsedPolicy, HclError> {
    let body: hcl::Body = hcl::parse(rules)?;
    let mut p = ParsedPolicy::default();
    for b in body.blocks() {
        let ctx = b.identifier.to_string();
        let attrs = attributes(&ctx, &b.body)?;
        let a = Attrs::new(&ctx, &attrs);
        match b.identifier.as_str() {
            "namespace" => {
                let name = label(b, 0).unwrap_or_else(|| "default".into());
                let mut rule = NamespaceRule::default();
                if let Some(pol) = a.str("policy")? {
                    rule.capabilities
                        .extend(expand_ns_policy(&pol).into_iter().map(String::from));
                    let var_caps: Vec<String> = match pol.as_str() {
                        "read" => vec!["read".into(), "list".into()],
                        "write" => vec![
                            "write".into(),
                            "read".into(),
                            "destroy".into(),
                            "list".into(),
                        ],
                        _ => vec![],
                    };
                    if !var_caps.is_empty() {
                        rule.variables.push(("*".into(), var_caps));
                    }
                }
                for c in a.strings("capabilities")?.unwrap_or_default() {
                    rule.capabilities.push(c);
                }
                for vb in b
                    .body
                    .blocks()
                    .filter(|x| x.identifier.as_str() == "variables")
                {
                    for pb in vb.body.blocks().filter(|x| x.identifier.as_str() == "path") {
                        let glob = label(pb, 0).unwrap_or_default();
                        let pa = attributes(&ctx, &pb.body)?;
                        let caps = Attrs::new(&ctx, &pa)
                            .strings("capabilities")?
                            .unwrap_or_default();
                        rule.variables.push((glob, caps));
                    }
                }
                p.namespaces.push((name, rule));
            }
            "node" => p.node = a.str("policy")?.unwrap_or_default(),
            "agent" => p.agent = a.str("policy")?.unwrap_or_default(),
            "operator" => p.operator = a.str("policy")?.unwrap_or_default(),
            _ => {}
        }
    }
    Ok(p)
}
