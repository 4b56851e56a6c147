//! A volume spec's `constraint` blocks (Nomad's, as `nomad volume create` takes them for
//! dynamic host volumes) and the node facts each agent evaluates them against: a node
//! that does not satisfy every constraint offers no placeholder of the volume.
//!
//! Targets and operators as Nomad's scheduler reads them (`scheduler/feasible/feasible.go`
//! `resolveTarget`, `checkConstraint`); the operators dhv-binder does not evaluate
//! (`regexp`, `version`, `semver`, `<`…) and `distinct_hosts`/`distinct_property` (Nomad
//! refuses them on host volumes: "host volumes of the same name are always on distinct
//! hosts") are refused at create.

pub use crate::nomad::types::NodeFacts;
use serde::{Deserialize, Serialize};

/// One `constraint { attribute operator value }` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraint {
    /// `${node.unique.name}`, `${node.unique.id}`, `${node.class}`, `${node.datacenter}`,
    /// `${node.pool}`, `${meta.<key>}` or `${attr.<key>}`.
    pub attribute: String,
    /// `=` (the default), `==`, `is`, `!=`, `not`, `is_set`, `is_not_set`,
    /// `set_contains`, `set_contains_all`, `set_contains_any`.
    pub operator: String,
    /// A literal (comma-separated for the `set_contains*` operators); empty for `is_set`
    /// and `is_not_set`.
    #[serde(default)]
    pub value: String,
}

/// The operators dhv-binder evaluates.
pub const OPERATORS: [&str; 10] = [
    "=",
    "==",
    "is",
    "!=",
    "not",
    "is_set",
    "is_not_set",
    "set_contains",
    "set_contains_all",
    "set_contains_any",
];

/// A constraint dhv-binder refuses at create.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    #[error("constraint attribute {0:?} is not one dhv-binder evaluates: use ${{node.unique.name}}, ${{node.unique.id}}, ${{node.class}}, ${{node.datacenter}}, ${{node.pool}}, ${{meta.<key>}} or ${{attr.<key>}}")]
    Attribute(String),
    #[error("constraint operator {0:?} is refused: host volumes of the same name are always on distinct hosts (Nomad refuses it too)")]
    Distinct(String),
    #[error("constraint operator {0:?} is not one dhv-binder evaluates: use one of =, !=, is_set, is_not_set, set_contains, set_contains_all, set_contains_any")]
    Operator(String),
    #[error("constraint on {0} needs a value")]
    NoValue(String),
    #[error("constraint: {0}")]
    Shape(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConstraint {
    #[serde(default)]
    attribute: String,
    #[serde(default)]
    operator: String,
    #[serde(default)]
    value: String,
}

/// The `constraint` blocks of a spec as parsed (one block is an object, several an array),
/// checked.
pub fn from_blocks(v: Option<hcl::Value>) -> Result<Vec<Constraint>, ConstraintError> {
    let shape = |e: hcl::Error| ConstraintError::Shape(e.to_string());
    let raw: Vec<RawConstraint> = match v {
        None => Vec::new(),
        Some(v @ hcl::Value::Array(_)) => hcl::from_value(v).map_err(shape)?,
        Some(v) => vec![hcl::from_value(v).map_err(shape)?],
    };
    raw.iter()
        .map(|c| Constraint::new(&c.attribute, &c.operator, &c.value))
        .collect()
}

impl Constraint {
    /// Checks and normalises a block as written (an empty operator is `=`).
    pub fn new(attribute: &str, operator: &str, value: &str) -> Result<Self, ConstraintError> {
        let operator = if operator.is_empty() { "=" } else { operator };
        if matches!(operator, "distinct_hosts" | "distinct_property") {
            return Err(ConstraintError::Distinct(operator.into()));
        }
        if !OPERATORS.contains(&operator) {
            return Err(ConstraintError::Operator(operator.into()));
        }
        let known = [
            "${node.unique.name}",
            "${node.unique.id}",
            "${node.class}",
            "${node.datacenter}",
            "${node.pool}",
        ]
        .contains(&attribute)
            || ["${meta.", "${attr."].iter().any(|p| {
                attribute
                    .strip_prefix(p)
                    .and_then(|k| k.strip_suffix('}'))
                    .is_some_and(|k| !k.is_empty() && !k.contains(['{', '}', '$']))
            });
        if !known {
            return Err(ConstraintError::Attribute(attribute.into()));
        }
        if value.is_empty() && !matches!(operator, "is_set" | "is_not_set") {
            return Err(ConstraintError::NoValue(attribute.into()));
        }
        Ok(Constraint {
            attribute: attribute.into(),
            operator: operator.into(),
            value: value.into(),
        })
    }

    /// Whether `node` satisfies the constraint (Nomad's `checkConstraint`: a missing
    /// attribute fails every operator but `!=`, `not` and `is_not_set`). An operator this
    /// build does not know (a record written by a newer one) is not satisfied.
    pub fn satisfied_by(&self, node: &NodeFacts) -> bool {
        let l = node.resolve(&self.attribute);
        let r = self.value.as_str();
        let set = |s: &str| -> Vec<String> {
            s.split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect()
        };
        match (self.operator.as_str(), l) {
            ("=" | "==" | "is", Some(l)) => l == r,
            ("!=" | "not", l) => l != Some(r),
            ("is_set", l) => l.is_some(),
            ("is_not_set", l) => l.is_none(),
            ("set_contains" | "set_contains_all", Some(l)) => {
                let have = set(l);
                set(r).iter().all(|x| have.contains(x))
            }
            ("set_contains_any", Some(l)) => {
                let have = set(l);
                set(r).iter().any(|x| have.contains(x))
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.attribute, self.operator, self.value)
    }
}

/// The first of `constraints` `node` does not satisfy.
pub fn unsatisfied<'a>(node: &NodeFacts, constraints: &'a [Constraint]) -> Option<&'a Constraint> {
    constraints.iter().find(|c| !c.satisfied_by(node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn node() -> NodeFacts {
        NodeFacts {
            id: "n1".into(),
            name: "node-1".into(),
            class: "db".into(),
            datacenter: "dc1".into(),
            pool: "default".into(),
            attributes: BTreeMap::from([("kernel.name".into(), "linux".into())]),
            meta: BTreeMap::from([("rack".into(), "r1".into()), ("zones".into(), "a,b".into())]),
        }
    }

    /// Targets resolve as Nomad's `resolveTarget`; operators as its `checkConstraint`.
    #[test]
    fn constraints_evaluate_as_nomads_scheduler_does() {
        let n = node();
        let c = |a: &str, o: &str, v: &str| Constraint::new(a, o, v).unwrap().satisfied_by(&n);
        assert!(c("${node.unique.name}", "", "node-1"));
        assert!(!c("${node.unique.name}", "=", "node-2"));
        assert!(c("${meta.rack}", "=", "r1"));
        assert!(!c("${meta.missing}", "=", "r1"));
        assert!(
            c("${meta.missing}", "!=", "r1"),
            "Nomad: != holds for a missing value"
        );
        assert!(c("${attr.kernel.name}", "is_set", ""));
        assert!(c("${meta.missing}", "is_not_set", ""));
        assert!(c("${node.class}", "!=", "web"));
        assert!(c("${node.datacenter}", "==", "dc1"));
        assert!(c("${meta.zones}", "set_contains", "b"));
        assert!(!c("${meta.zones}", "set_contains_all", "a,c"));
        assert!(c("${meta.zones}", "set_contains_any", "a,c"));
    }

    #[test]
    fn unknown_targets_operators_and_distinct_ones_are_refused() {
        assert!(matches!(
            Constraint::new("${node.unique.nam}", "=", "x"),
            Err(ConstraintError::Attribute(_))
        ));
        assert!(matches!(
            Constraint::new("${meta.}", "=", "x"),
            Err(ConstraintError::Attribute(_))
        ));
        assert!(matches!(
            Constraint::new("${meta.rack}", "regexp", "r.*"),
            Err(ConstraintError::Operator(_))
        ));
        assert!(matches!(
            Constraint::new("${meta.rack}", "distinct_hosts", ""),
            Err(ConstraintError::Distinct(_))
        ));
        assert!(matches!(
            Constraint::new("${meta.rack}", "=", ""),
            Err(ConstraintError::NoValue(_))
        ));
    }
}
