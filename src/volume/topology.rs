//! Topology: where a plugin's storage is reachable from, as its fingerprint reports it
//! (`"topology": {"zone": "a"}`, CSI's `accessible_topology`), and where a volume may be
//! used, as its spec requests it (`topology_request { required { topology { segments {…} } }
//! preferred {…} }`, the shape of Nomad's CSI volume specification).
//!
//! A node offers a volume with `required` topologies only when its plugin's topology
//! contains every segment of at least one of them (Nomad's `CSITopology.MatchFound` and
//! `Contains`, `nomad/structs/node.go`, as `scheduler/feasible/feasible.go`
//! `CSIVolumeChecker.isFeasible` applies it); a plugin that reports no topology satisfies
//! none. Only such a node runs the volume's create. `preferred` decides which of those
//! nodes runs the create first (Nomad hands it to the storage provider's create).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Segment name → value (`zone` → `us-east-1a`).
pub type Segments = BTreeMap<String, String>;

/// The most segments one topology holds.
pub const MAX_SEGMENTS: usize = 8;
/// The most characters of a segment's name or value (CSI: 63 for a value; a name may
/// carry a prefix, so twice that).
pub const MAX_SEGMENT_CHARS: usize = 126;
/// The most topologies `required` or `preferred` lists.
pub const MAX_TOPOLOGIES: usize = 16;

/// One topology: the segments a node's must all contain.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    pub segments: Segments,
}

/// A spec's `topology_request`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TopologyRequest {
    /// A node offers the volume only if its plugin's topology contains one of these; any
    /// node when empty.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub required: Vec<Topology>,
    /// Among the nodes that may, those whose plugin's topology contains one of these run
    /// the create first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub preferred: Vec<Topology>,
}

/// A topology that dhv-binder refuses (in a spec at create, or in a plugin's fingerprint).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("topology_request: {0}")]
    Shape(String),
    #[error("{what}: a topology is missing its segments (Nomad: \"required topology is missing segments field\")")]
    NoSegments { what: &'static str },
    #[error("{what}: at most {MAX_TOPOLOGIES} topologies")]
    TooMany { what: &'static str },
    #[error("topology segment {0:?}: names and values are 1 to {MAX_SEGMENT_CHARS} characters of letters, digits, '-', '_', '.' and '/', at most {MAX_SEGMENTS} segments")]
    Segment(String),
}

/// Checks a topology's segments: at most [`MAX_SEGMENTS`], each name and value 1 to
/// [`MAX_SEGMENT_CHARS`] characters of ASCII letters, digits, `-`, `_`, `.`, `/` (CSI's
/// rules, loosened as Nomad does for the names' prefixes).
pub fn check_segments(s: &Segments) -> Result<(), TopologyError> {
    let ok = |x: &str| {
        !x.is_empty()
            && x.len() <= MAX_SEGMENT_CHARS
            && x.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    };
    if s.len() > MAX_SEGMENTS {
        return Err(TopologyError::Segment(format!("{} segments", s.len())));
    }
    match s.iter().find(|(k, v)| !ok(k) || !ok(v)) {
        Some((k, v)) => Err(TopologyError::Segment(format!("{k}={v}"))),
        None => Ok(()),
    }
}

/// True when `node` contains every segment of `t` (Nomad's `CSITopology.Contains`).
fn contains(node: &Segments, t: &Topology) -> bool {
    t.segments.iter().all(|(k, v)| node.get(k) == Some(v))
}

/// `segments` as `zone=a,rack=r1`, for the status and the log.
pub fn show(segments: &Segments) -> String {
    if segments.is_empty() {
        return "none".into();
    }
    segments
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

impl TopologyRequest {
    /// True when the spec has no `topology_request` (omitted from the record).
    pub fn is_empty(&self) -> bool {
        self.required.is_empty() && self.preferred.is_empty()
    }

    /// Whether a node whose plugin reports `node` (`None`: no fingerprint) may offer the
    /// volume (Nomad's `MatchFound` over `required`; no requirement: every node).
    pub fn allows(&self, node: Option<&Segments>) -> bool {
        self.required.is_empty()
            || node.is_some_and(|n| self.required.iter().any(|t| contains(n, t)))
    }

    /// Whether `node` matches a preferred topology (no preference: every node does).
    pub fn prefers(&self, node: Option<&Segments>) -> bool {
        self.preferred.is_empty()
            || node.is_some_and(|n| self.preferred.iter().any(|t| contains(n, t)))
    }

    /// The required topologies as written, for why a node does not offer the volume.
    pub fn show_required(&self) -> String {
        self.required
            .iter()
            .map(|t| format!("{{{}}}", show(&t.segments)))
            .collect::<Vec<_>>()
            .join(" or ")
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    #[serde(default)]
    required: Option<RawSet>,
    #[serde(default)]
    preferred: Option<RawSet>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSet {
    /// One block deserializes as an object, several as an array.
    #[serde(default)]
    topology: Option<hcl::Value>,
}

fn topologies(set: Option<RawSet>, what: &'static str) -> Result<Vec<Topology>, TopologyError> {
    let shape = |e: hcl::Error| TopologyError::Shape(e.to_string());
    let raw: Vec<Topology> = match set.and_then(|s| s.topology) {
        None => Vec::new(),
        Some(v @ hcl::Value::Array(_)) => hcl::from_value(v).map_err(shape)?,
        Some(v) => vec![hcl::from_value(v).map_err(shape)?],
    };
    if raw.len() > MAX_TOPOLOGIES {
        return Err(TopologyError::TooMany { what });
    }
    for t in &raw {
        if t.segments.is_empty() {
            return Err(TopologyError::NoSegments { what });
        }
        check_segments(&t.segments)?;
    }
    Ok(raw)
}

/// The spec's `topology_request` block as parsed (absent: none), checked as Nomad's
/// `CSIVolume.Validate` does (every topology has segments) and bounded.
pub fn from_block(v: Option<hcl::Value>) -> Result<TopologyRequest, TopologyError> {
    let Some(v) = v else {
        return Ok(TopologyRequest::default());
    };
    let raw: RawRequest = hcl::from_value(v).map_err(|e| TopologyError::Shape(e.to_string()))?;
    Ok(TopologyRequest {
        required: topologies(raw.required, "topology_request.required")?,
        preferred: topologies(raw.preferred, "topology_request.preferred")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(pairs: &[(&str, &str)]) -> Segments {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A node offers when its topology contains every segment of one required topology
    /// (Nomad's `MatchFound`/`Contains`); a plugin with no topology satisfies no
    /// requirement; no requirement allows every node.
    #[test]
    fn required_topologies_match_as_nomads_csi_checker_does() {
        let r = TopologyRequest {
            required: vec![
                Topology {
                    segments: seg(&[("zone", "a"), ("rack", "r1")]),
                },
                Topology {
                    segments: seg(&[("zone", "b")]),
                },
            ],
            preferred: vec![Topology {
                segments: seg(&[("zone", "b")]),
            }],
        };
        assert!(r.allows(Some(&seg(&[("zone", "a"), ("rack", "r1"), ("row", "3")]))));
        assert!(!r.allows(Some(&seg(&[("zone", "a"), ("rack", "r2")]))));
        assert!(r.allows(Some(&seg(&[("zone", "b")]))));
        assert!(!r.allows(Some(&Segments::new())));
        assert!(!r.allows(None));
        assert!(TopologyRequest::default().allows(None));
        assert!(r.prefers(Some(&seg(&[("zone", "b")]))));
        assert!(!r.prefers(Some(&seg(&[("zone", "a")]))));
        assert_eq!(r.show_required(), "{rack=r1,zone=a} or {zone=b}");
    }

    /// Nomad's block shape parses (one or several `topology` blocks); a topology without
    /// segments, an unknown field and a bad segment are refused by name.
    #[test]
    fn the_block_parses_in_nomads_shape_and_bad_ones_are_refused() {
        let parse = |text: &str| {
            let body: hcl::Body = hcl::from_str(text).unwrap();
            let v: hcl::Value = hcl::from_body(body).unwrap();
            from_block(
                v.as_object()
                    .and_then(|o| o.get("topology_request"))
                    .cloned(),
            )
        };
        let r = parse(
            "topology_request {\n required {\n  topology {\n   segments { zone = \"a\" }\n  }\n  topology { segments = { zone = \"b\", rack = \"r1\" } }\n }\n preferred {\n  topology { segments = { zone = \"b\" } }\n }\n}",
        )
        .unwrap();
        assert_eq!(r.required.len(), 2);
        assert_eq!(r.preferred[0].segments, seg(&[("zone", "b")]));
        let r = parse(
            "topology_request {\n required {\n  topology { segments = { zone = \"a\" } }\n }\n}",
        )
        .unwrap();
        assert_eq!(r.required.len(), 1);
        assert!(r.preferred.is_empty());
        assert!(matches!(
            parse("topology_request {\n required {\n  topology { segments = {} }\n }\n}"),
            Err(TopologyError::NoSegments { .. })
        ));
        assert!(matches!(
            parse(
                "topology_request {\n requird {\n  topology { segments = { zone = \"a\" } }\n }\n}"
            ),
            Err(TopologyError::Shape(_))
        ));
        assert!(matches!(
            parse("topology_request {\n required {\n  topology { segments = { zone = \"a b\" } }\n }\n}"),
            Err(TopologyError::Segment(_))
        ));
        assert!(check_segments(&seg(&[("topology.example.com/zone", "us-east-1a")])).is_ok());
        assert!(check_segments(&seg(&[("zone", "")])).is_err());
    }
}
