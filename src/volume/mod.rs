//! Deferred volumes: the spec an operator writes (HCL, shaped like `nomad volume create`)
//! and the cluster-wide record dhv-binder keeps for it in a Nomad Variable
//! (`dhv-binder/volumes/<name>` in the volume's namespace).

pub mod availability;
pub mod constraint;
pub mod final_failure;
pub mod mount_options;
mod nesting;
pub mod secret_refs;
pub mod topology;

use crate::nomad::types::Variable;
use crate::volume::mount_options::{MountOptions, MountOptionsError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Variable path prefix under which volume records live.
pub const RECORD_PREFIX: &str = "dhv-binder/volumes/";

/// Access modes a deferred volume may declare (CSI's names, as Nomad uses them, plus
/// Nomad 1.10's host-volume mode `single-node-single-writer`: one writing allocation at a
/// time, even on one node).
pub const ACCESS_MODES: [&str; 6] = [
    "single-node-reader-only",
    "single-node-writer",
    "single-node-single-writer",
    "single-node-multi-writer",
    "multi-node-reader-only",
    "multi-node-multi-writer",
];

/// Attachment modes.
pub const ATTACHMENT_MODES: [&str; 2] = ["file-system", "block-device"];

/// Bad input in a volume spec or identifier. Nothing was changed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SpecError {
    #[error("volume spec is not valid HCL: {0}")]
    Hcl(String),
    #[error("{field} is required")]
    Missing { field: &'static str },
    #[error("{field} {value:?} is not allowed: use letters, digits, '_', '.', '-', starting with a letter, digit or '_' (no '..'), at most 100 characters{extra}")]
    BadIdentifier {
        field: &'static str,
        value: String,
        extra: &'static str,
    },
    #[error("type must be \"host\" (dhv-binder serves dynamic host volumes), got {0:?}")]
    BadType(String),
    #[error("access_mode {0:?} is not one of {ACCESS_MODES:?}")]
    BadAccessMode(String),
    #[error("attachment_mode {0:?} is not one of {ATTACHMENT_MODES:?}")]
    BadAttachmentMode(String),
    #[error("{field} {value:?} is not a size (examples: 1073741824, \"10GiB\", \"500MB\")")]
    BadSize { field: &'static str, value: String },
    #[error("capacity_min ({min} bytes) is larger than capacity_max ({max} bytes)")]
    CapacityOrder { min: u64, max: u64 },
    #[error("snapshot_id and clone_id are both set: a volume starts from one source at most")]
    TwoSources,
    #[error("snapshot_id {0:?} is not a snapshot ID (a UUID, as `dhv-binder volume snapshot list` shows)")]
    BadSnapshotId(String),
    #[error("{field:?} is not a volume spec field dhv-binder knows ({known}): remove it (dhv-binder refuses what it cannot honour rather than ignore it)")]
    UnknownField { field: String, known: String },
    #[error(transparent)]
    Constraint(#[from] constraint::ConstraintError),
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
    #[error("node_id is not supported: a deferred volume is published on whichever node runs its allocation; use node_pool to choose the nodes that may serve it")]
    NodeId,
    #[error("volume spec nests blocks, lists or parentheses deeper than {MAX_SPEC_DEPTH} levels (or is larger than {MAX_SPEC_BYTES} bytes): flatten it")]
    TooDeep,
    /// The text is not HCL: the parser stopped at `line`, `column` (both 1-based).
    #[error("volume spec is not valid HCL: line {line}, column {column}: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    /// A field of a block the spec kind does not know (`capability { acces_mode = … }`).
    #[error("{field:?} is not a field of a {block} block ({known}): remove it or fix its name")]
    UnknownBlockField {
        block: &'static str,
        field: String,
        known: &'static str,
    },
    /// A field that takes a string was given something else.
    #[error("{field} must be a string (in double quotes)")]
    NotAString { field: String },
    /// A field that is a block (`parameters { … }`) was given as an attribute, or the
    /// other way round.
    #[error("{field} must be {shape}")]
    WrongShape {
        field: &'static str,
        shape: &'static str,
    },
    /// `mount_options` asks for a flag outside the allow-list, contradicting flags, or a
    /// bad `fs_type`.
    #[error(transparent)]
    MountOptions(#[from] MountOptionsError),
    /// A `secret_ref` block that names no usable place.
    #[error(transparent)]
    SecretRef(#[from] secret_refs::SecretRefError),
}

impl SpecError {
    /// The line (1-based) of `text` the error is about, when it names a place: the
    /// attribute or block it refuses (for a bad access or attachment mode, the capability
    /// attribute with that value), or where the HCL parser stopped. `None` for an error
    /// about the spec as a whole (a required field missing, too deep).
    pub fn line_in(&self, text: &str) -> Option<usize> {
        let top = |field: &str| spec_line(text, None, field, None);
        match self {
            SpecError::Syntax { line, .. } => Some(*line),
            SpecError::Missing { .. } | SpecError::TooDeep | SpecError::Hcl(_) => None,
            SpecError::BadIdentifier { field, .. } | SpecError::BadSize { field, .. } => top(field),
            SpecError::BadType(_) => top("type"),
            SpecError::BadAccessMode(v) => {
                spec_line(text, Some("capability"), "access_mode", Some(v))
            }
            SpecError::BadAttachmentMode(v) => {
                spec_line(text, Some("capability"), "attachment_mode", Some(v))
            }
            SpecError::CapacityOrder { .. } => top("capacity_min"),
            // The second of the two is the one too many.
            SpecError::TwoSources => top("snapshot_id").max(top("clone_id")),
            SpecError::BadSnapshotId(_) => top("snapshot_id"),
            SpecError::UnknownField { field, .. } => top(field),
            SpecError::Constraint(_) => top("constraint"),
            SpecError::Topology(_) => top("topology_request"),
            SpecError::NodeId => top("node_id"),
            SpecError::UnknownBlockField { block, field, .. } => {
                spec_line(text, Some(block), field, None)
            }
            SpecError::NotAString { field } => match field.split_once('.') {
                Some((block, f)) => spec_line(text, Some(block), f, None),
                None => top(field),
            },
            SpecError::WrongShape { field, .. } => match field.split_once('.') {
                Some((block, f)) => spec_line(text, Some(block), f, None),
                None => top(field),
            },
            SpecError::MountOptions(MountOptionsError::BadFsType(_)) => {
                spec_line(text, Some("mount_options"), "fs_type", None)
            }
            SpecError::MountOptions(_) => {
                spec_line(text, Some("mount_options"), "mount_flags", None)
            }
            SpecError::SecretRef(_) => top("secret_ref"),
        }
    }

    /// The error as a compiler would print it: `<source>:<line>: <error>` (the line from
    /// [`SpecError::line_in`]), `<source>:<line>:<column>: …` for a syntax error, or
    /// `<source>: <error>` when it names no place. `source` is the file as the user gave
    /// it, or `<stdin>`.
    pub fn located(&self, source: &str, text: &str) -> String {
        match (self, self.line_in(text)) {
            (
                SpecError::Syntax {
                    line,
                    column,
                    message,
                },
                _,
            ) => format!("{source}:{line}:{column}: not valid HCL: {message}"),
            (_, Some(line)) => format!("{source}:{line}: {self}"),
            (_, None) => format!("{source}: {self}"),
        }
    }
}

/// The line (1-based) in a spec's `text` of the attribute or block `field`, at the top level
/// or in the blocks named `block`; with `value`, the first whose value is that string (else
/// the first of that name). `None` when the text does not parse or has no such field.
pub fn spec_line(
    text: &str,
    block: Option<&str>,
    field: &str,
    value: Option<&str>,
) -> Option<usize> {
    use hcl::edit::structure::{Body, Structure};
    use hcl::edit::Span as _;
    let body = hcl::edit::parser::parse_body(text).ok()?;
    fn named<'a>(body: &'a Body, field: &'a str) -> impl Iterator<Item = &'a Structure> + 'a {
        body.iter().filter(move |st| match st {
            Structure::Attribute(a) => a.key.as_str() == field,
            Structure::Block(b) => b.ident.as_str() == field,
        })
    }
    let candidates: Vec<&Structure> = match block {
        None => named(&body, field).collect(),
        Some(block) => named(&body, block)
            .filter_map(|st| st.as_block())
            .flat_map(|b| named(&b.body, field))
            .collect(),
    };
    let with_value = value.and_then(|v| {
        candidates.iter().find(|st| {
            st.as_attribute().is_some_and(
                |a| matches!(&a.value, hcl::edit::expr::Expression::String(s) if s.as_str() == v),
            )
        })
    });
    let st = with_value.or(candidates.first())?;
    let start = match st {
        Structure::Attribute(a) => a.key.span(),
        Structure::Block(b) => b.ident.span(),
    }
    .or_else(|| st.span())?
    .start;
    Some(text.get(..start)?.matches('\n').count() + 1)
}

/// Where a new volume's content comes from (`snapshot_id` or `clone_id` in the spec).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeSource {
    /// An empty volume.
    #[default]
    Empty,
    /// `snapshot_id = "<snapshot UUID>"`: the snapshot's content (plugin capability `snapshot`).
    SnapshotId(String),
    /// `clone_id = "<volume name>"`: a copy of another volume of the same namespace
    /// (plugin capability `clone`).
    CloneId(String),
}

impl VolumeSource {
    /// True for [`VolumeSource::Empty`].
    pub fn is_empty(&self) -> bool {
        matches!(self, VolumeSource::Empty)
    }
}

/// Deepest nesting of `{`, `[` and `(` a spec may have (the HCL parser recurses per level).
pub const MAX_SPEC_DEPTH: usize = 32;
/// Largest spec text accepted, in bytes.
pub const MAX_SPEC_BYTES: usize = 1 << 20;

/// One `capability { access_mode attachment_mode }` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    pub access_mode: String,
    pub attachment_mode: String,
}

/// A validated volume spec. Secrets are kept apart ([`VolumeRecord::secrets`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeSpec {
    /// Volume name; jobs use it as `volume { type = "host" source = "<name>" }`.
    pub name: String,
    pub namespace: String,
    /// Plugin executable name in each node's plugin directory.
    pub plugin_id: String,
    /// Bytes; 0 = unset.
    pub capacity_min: u64,
    /// Bytes; 0 = unset.
    pub capacity_max: u64,
    /// Nodes that may serve the volume; empty = all pools.
    pub node_pool: String,
    /// At least one; the first is used when a job does not say.
    pub capabilities: Vec<Capability>,
    pub parameters: BTreeMap<String, String>,
    /// Where the volume's content comes from; only read by `create`.
    #[serde(default, skip_serializing_if = "VolumeSource::is_empty")]
    pub source: VolumeSource,
    /// `mount_options { mount_flags fs_type }`: the flags every publish applies over the
    /// `nosuid,nodev` default ([`crate::volume::mount_options`]); omitted from the record when empty.
    #[serde(default, skip_serializing_if = "MountOptions::is_empty")]
    pub mount_options: MountOptions,
    /// `secret_ref "<name>" { … }`: where each secret the record does not hold lives, read
    /// by the node at each plugin call ([`secret_refs`]); omitted from the record when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secret_refs: BTreeMap<String, secret_refs::SecretRef>,
    /// Only nodes that satisfy every `constraint` block offer the volume; omitted when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<constraint::Constraint>,
    /// Only nodes whose plugin's topology satisfies `required` offer the volume; omitted when none.
    #[serde(default, skip_serializing_if = "topology::TopologyRequest::is_empty")]
    pub topology_request: topology::TopologyRequest,
    /// `volume update -availability` (not in the HCL); omitted from the record when `active`.
    #[serde(default, skip_serializing_if = "availability::Availability::is_active")]
    pub availability: availability::Availability,
}

#[derive(Deserialize)]
struct RawSpec {
    name: Option<String>,
    #[serde(rename = "type")]
    volume_type: Option<String>,
    namespace: Option<String>,
    plugin_id: Option<String>,
    capacity_min: Option<hcl::Value>,
    capacity_max: Option<hcl::Value>,
    node_pool: Option<String>,
    /// One block deserializes as an object, several as an array.
    #[serde(default)]
    capability: Option<hcl::Value>,
    #[serde(default)]
    parameters: BTreeMap<String, hcl::Value>,
    #[serde(default)]
    secrets: BTreeMap<String, hcl::Value>,
    snapshot_id: Option<String>,
    clone_id: Option<String>,
    #[serde(default)]
    mount_options: Option<RawMountOptions>,
    #[serde(default)]
    constraint: Option<hcl::Value>,
    topology_request: Option<hcl::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMountOptions {
    #[serde(default)]
    mount_flags: Vec<String>,
    #[serde(default)]
    fs_type: String,
}

/// The top-level fields of a `volume create` spec.
pub const SPEC_FIELDS: [&str; 16] = [
    "name",
    "type",
    "namespace",
    "plugin_id",
    "capacity_min",
    "capacity_max",
    "node_pool",
    "capability",
    "parameters",
    "secrets",
    "snapshot_id",
    "clone_id",
    "mount_options",
    "secret_ref",
    "constraint",
    "topology_request",
];

/// The fields only a `volume register` spec has besides [`SPEC_FIELDS`]: what the
/// plugin's create would have returned.
pub const REGISTER_FIELDS: [&str; 2] = ["context", "capacity"];

/// Refuses a top-level attribute or block the spec kind does not know, by name (as Nomad's
/// parser refuses unknown arguments): a dropped `constraint` would publish where the
/// operator excluded it. `constraint` and `node_id` say what to use instead.
fn check_fields(text: &str, register: bool) -> Result<(), SpecError> {
    use hcl::edit::expr::Expression;
    use hcl::edit::structure::Structure;
    let body = hcl::edit::parser::parse_body(text).map_err(|e| SpecError::Syntax {
        line: e.location().line(),
        column: e.location().column(),
        message: e.message().to_string(),
    })?;
    // Shapes first, in the order of the text: a string where a string goes, a block where
    // a block goes, and only known fields in a capability block.
    let blocks: [&'static str; 7] = [
        "constraint",
        "capability",
        "parameters",
        "secrets",
        "context",
        "mount_options",
        "secret_ref",
    ];
    let strings = [
        "name",
        "type",
        "namespace",
        "plugin_id",
        "node_pool",
        "snapshot_id",
        "clone_id",
    ];
    let is_string = |e: &Expression| {
        matches!(
            e,
            Expression::String(_) | Expression::StringTemplate(_) | Expression::HeredocTemplate(_)
        )
    };
    for st in body.iter() {
        match st {
            Structure::Attribute(a) => {
                let key = a.key.as_str();
                if let Some(b) = blocks.iter().find(|b| **b == key) {
                    if !(register || *b != "context") {
                        continue;
                    }
                    return Err(SpecError::WrongShape {
                        field: b,
                        shape: match *b {
                            "capability" => "a block: `capability { access_mode = \"…\" attachment_mode = \"…\" }`",
                            "constraint" => "a block: `constraint { attribute = \"${meta.rack}\" value = \"r1\" }`",
                            "mount_options" => "a block: `mount_options { mount_flags = [\"noexec\"] }`",
                            "secret_ref" => "a labelled block: `secret_ref \"password\" { variable = \"…\" item = \"…\" }`",
                            _ => "a block of `key = \"value\"` lines, e.g. `parameters { export = \"/srv\" }`",
                        },
                    });
                }
                if strings.contains(&key) && !is_string(&a.value) {
                    return Err(SpecError::NotAString { field: key.into() });
                }
            }
            Structure::Block(b) => {
                let ident = b.ident.as_str();
                if let Some(f) = strings.iter().find(|f| **f == ident) {
                    return Err(SpecError::WrongShape {
                        field: f,
                        shape: "an attribute: `name = \"value\"`",
                    });
                }
                if ident == "mount_options" {
                    check_mount_options_block(b)?;
                    continue;
                }
                let Some(&(block, fields, known)) = STRING_BLOCKS.iter().find(|b| b.0 == ident)
                else {
                    continue;
                };
                for inner in b.body.iter() {
                    let key = match inner {
                        Structure::Attribute(a) => a.key.as_str(),
                        Structure::Block(b) => b.ident.as_str(),
                    };
                    match inner.as_attribute() {
                        Some(a) if fields.contains(&key) => {
                            if !is_string(&a.value) {
                                return Err(SpecError::NotAString {
                                    field: format!("{block}.{key}"),
                                });
                            }
                        }
                        _ => {
                            return Err(SpecError::UnknownBlockField {
                                block,
                                field: key.into(),
                                known,
                            })
                        }
                    }
                }
            }
        }
    }
    let names = body.iter().map(|st| match st {
        Structure::Attribute(a) => a.key.as_str().to_string(),
        Structure::Block(b) => b.ident.as_str().to_string(),
    });
    for name in names {
        let known = SPEC_FIELDS.contains(&name.as_str())
            || (register && REGISTER_FIELDS.contains(&name.as_str()));
        if known {
            continue;
        }
        return Err(match name.as_str() {
            "node_id" => SpecError::NodeId,
            _ => SpecError::UnknownField {
                field: name,
                known: if register {
                    [&SPEC_FIELDS[..], &REGISTER_FIELDS[..]].concat().join(", ")
                } else {
                    SPEC_FIELDS.join(", ")
                },
            },
        });
    }
    Ok(())
}

/// The blocks of string fields only: name, fields, the fields as the error lists them.
const STRING_BLOCKS: [(&str, &[&str], &str); 2] = [
    (
        "capability",
        &["access_mode", "attachment_mode"],
        "access_mode, attachment_mode",
    ),
    (
        "constraint",
        &["attribute", "operator", "value"],
        "attribute, operator, value",
    ),
];

/// The fields of a `mount_options` block: `mount_flags` a list of strings, `fs_type` a
/// string, nothing else.
fn check_mount_options_block(b: &hcl::edit::structure::Block) -> Result<(), SpecError> {
    use hcl::edit::expr::Expression;
    use hcl::edit::structure::Structure;
    for inner in b.body.iter() {
        let (key, value) = match inner {
            Structure::Attribute(a) => (a.key.as_str(), Some(&a.value)),
            Structure::Block(b) => (b.ident.as_str(), None),
        };
        match (key, value) {
            ("mount_flags", Some(Expression::Array(items)))
                if items.iter().all(|e| matches!(e, Expression::String(_))) => {}
            ("mount_flags", _) => {
                return Err(SpecError::WrongShape {
                    field: "mount_options.mount_flags",
                    shape: "a list of strings: `mount_flags = [\"noexec\"]`",
                })
            }
            ("fs_type", Some(Expression::String(_))) => {}
            ("fs_type", _) => {
                return Err(SpecError::NotAString {
                    field: "mount_options.fs_type".into(),
                })
            }
            _ => {
                return Err(SpecError::UnknownBlockField {
                    block: "mount_options",
                    field: key.into(),
                    known: "mount_flags, fs_type",
                })
            }
        }
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCapability {
    access_mode: Option<String>,
    attachment_mode: Option<String>,
}

/// Checks a name-like identifier: `[A-Za-z0-9_.-]{1,100}`, not `.`/`..`-containing.
/// With `allow_index`, one trailing `[N]` (per_alloc) is accepted.
pub fn validate_identifier(
    field: &'static str,
    value: &str,
    allow_index: bool,
) -> Result<(), SpecError> {
    let bad = || SpecError::BadIdentifier {
        field,
        value: value.to_string(),
        extra: if allow_index {
            ", optionally ending in [N]"
        } else {
            ""
        },
    };
    let base = match (allow_index, value.strip_suffix(']')) {
        (true, Some(rest)) => {
            let (base, idx) = rest.rsplit_once('[').ok_or_else(bad)?;
            if idx.is_empty() || idx.len() > 6 || !idx.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            base
        }
        _ => value,
    };
    let ok = !base.is_empty()
        && base.len() <= 100
        && !base.starts_with(['-', '.'])
        && !base.contains("..")
        && base != "."
        && base
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(bad())
    }
}

/// Checks an allocation ID: a UUID in Nomad's lower-case hyphenated form.
pub fn is_alloc_id(s: &str) -> bool {
    s.len() == 36 && uuid::Uuid::parse_str(s).is_ok_and(|u| u.hyphenated().to_string() == s)
}

fn hcl_string(v: &hcl::Value) -> String {
    match v {
        hcl::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn parse_size(field: &'static str, v: Option<&hcl::Value>) -> Result<u64, SpecError> {
    let Some(v) = v else { return Ok(0) };
    let bad = || SpecError::BadSize {
        field,
        value: hcl_string(v),
    };
    match v {
        hcl::Value::Number(n) => n.as_u64().ok_or_else(bad),
        hcl::Value::String(s) => {
            if let Ok(n) = s.trim().parse::<u64>() {
                return Ok(n);
            }
            s.trim()
                .parse::<bytesize::ByteSize>()
                .map(|b| b.as_u64())
                .map_err(|_| bad())
        }
        _ => Err(bad()),
    }
}

/// Parses and validates a `volume create` spec's text. Returns the spec and its secrets.
/// A field it does not know is refused by name ([`SpecError::UnknownField`]).
pub fn parse_spec(text: &str) -> Result<(VolumeSpec, BTreeMap<String, String>), SpecError> {
    parse_spec_of(text, false)
}

/// [`parse_spec`] for a `volume register` spec, which may also carry [`REGISTER_FIELDS`].
pub fn parse_register_spec(
    text: &str,
) -> Result<(VolumeSpec, BTreeMap<String, String>), SpecError> {
    parse_spec_of(text, true)
}

fn parse_spec_of(
    text: &str,
    register: bool,
) -> Result<(VolumeSpec, BTreeMap<String, String>), SpecError> {
    if text.len() > MAX_SPEC_BYTES || nesting::depth(text) > MAX_SPEC_DEPTH {
        return Err(SpecError::TooDeep);
    }
    check_fields(text, register)?;
    let raw: RawSpec = hcl::from_str(text).map_err(|e| SpecError::Hcl(e.to_string()))?;
    let name = raw.name.unwrap_or_default();
    if name.is_empty() {
        return Err(SpecError::Missing { field: "name" });
    }
    validate_identifier("name", &name, true)?;
    let volume_type = raw.volume_type.unwrap_or_else(|| "host".into());
    if volume_type != "host" {
        return Err(SpecError::BadType(volume_type));
    }
    let namespace = raw.namespace.unwrap_or_else(|| "default".into());
    validate_identifier("namespace", &namespace, false)?;
    let plugin_id = raw.plugin_id.unwrap_or_default();
    if plugin_id.is_empty() {
        return Err(SpecError::Missing { field: "plugin_id" });
    }
    validate_identifier("plugin_id", &plugin_id, false)?;
    let node_pool = raw.node_pool.unwrap_or_default();
    if !node_pool.is_empty() {
        validate_identifier("node_pool", &node_pool, false)?;
    }
    let capacity_min = parse_size("capacity_min", raw.capacity_min.as_ref())?;
    let capacity_max = parse_size("capacity_max", raw.capacity_max.as_ref())?;
    if capacity_max > 0 && capacity_min > capacity_max {
        return Err(SpecError::CapacityOrder {
            min: capacity_min,
            max: capacity_max,
        });
    }
    let raw_caps: Vec<RawCapability> = match raw.capability {
        None => Vec::new(),
        Some(v @ hcl::Value::Array(_)) => {
            hcl::from_value(v).map_err(|e| SpecError::Hcl(format!("capability: {e}")))?
        }
        Some(v) => {
            vec![hcl::from_value(v).map_err(|e| SpecError::Hcl(format!("capability: {e}")))?]
        }
    };
    let mut capabilities = Vec::new();
    for c in raw_caps {
        let access_mode = c.access_mode.unwrap_or_else(|| "single-node-writer".into());
        if !ACCESS_MODES.contains(&access_mode.as_str()) {
            return Err(SpecError::BadAccessMode(access_mode));
        }
        let attachment_mode = c.attachment_mode.unwrap_or_else(|| "file-system".into());
        if !ATTACHMENT_MODES.contains(&attachment_mode.as_str()) {
            return Err(SpecError::BadAttachmentMode(attachment_mode));
        }
        capabilities.push(Capability {
            access_mode,
            attachment_mode,
        });
    }
    if capabilities.is_empty() {
        capabilities.push(Capability {
            access_mode: "single-node-writer".into(),
            attachment_mode: "file-system".into(),
        });
    }
    let source = match (
        raw.snapshot_id.filter(|s| !s.is_empty()),
        raw.clone_id.filter(|s| !s.is_empty()),
    ) {
        (Some(_), Some(_)) => return Err(SpecError::TwoSources),
        (Some(id), None) => {
            if uuid::Uuid::parse_str(&id).is_err() {
                return Err(SpecError::BadSnapshotId(id));
            }
            VolumeSource::SnapshotId(id)
        }
        (None, Some(name)) => {
            validate_identifier("clone_id", &name, true)?;
            VolumeSource::CloneId(name)
        }
        (None, None) => VolumeSource::Empty,
    };
    let parameters = raw
        .parameters
        .iter()
        .map(|(k, v)| (k.clone(), hcl_string(v)))
        .collect();
    let secrets = raw
        .secrets
        .iter()
        .map(|(k, v)| (k.clone(), hcl_string(v)))
        .collect();
    let mount_options = match raw.mount_options {
        None => MountOptions::default(),
        Some(m) => MountOptions::new(m.mount_flags, m.fs_type)?,
    };
    let body = hcl::edit::parser::parse_body(text).map_err(|e| SpecError::Hcl(e.to_string()))?;
    let secret_refs = secret_refs::parse(&body, &secrets)?;
    let constraints = constraint::from_blocks(raw.constraint)?;
    let topology_request = topology::from_block(raw.topology_request)?;
    Ok((
        VolumeSpec {
            name,
            namespace,
            plugin_id,
            capacity_min,
            capacity_max,
            node_pool,
            capabilities,
            parameters,
            source,
            mount_options,
            secret_refs,
            constraints,
            topology_request,
            availability: Default::default(),
        },
        secrets,
    ))
}

/// Where a volume is in its cluster-wide life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeState {
    /// Recorded; waiting for a node with the plugin to run `create`.
    Pending,
    /// A node (`worker_node`) is running the plugin's `create`.
    Creating,
    /// Created; nodes offer placeholders and publish on demand.
    Ready,
    /// `create` failed; see `error`. Delete the record and create again.
    Failed,
    /// Delete requested; placeholders are withdrawn and a node runs the plugin's `delete`.
    Deleting,
}

impl VolumeState {
    /// The lower-case name used in the record and in output.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Pending => "pending",
            VolumeState::Creating => "creating",
            VolumeState::Ready => "ready",
            VolumeState::Failed => "failed",
            VolumeState::Deleting => "deleting",
        }
    }
}

/// Where a requested growth is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpansionState {
    /// Waiting for a node to take it.
    Requested,
    /// `node` is running the plugin's `expand`.
    Running,
    /// The volume is published and the plugin cannot grow it online: it runs once the
    /// volume is published nowhere, before its next publish.
    AtNextPublish,
    /// The plugin's `expand` failed (see `error`); `volume create` with the spec again retries.
    Failed,
}

impl ExpansionState {
    /// The name shown by `volume status`.
    pub fn as_str(self) -> &'static str {
        match self {
            ExpansionState::Requested => "requested",
            ExpansionState::Running => "running",
            ExpansionState::AtNextPublish => "at-next-publish",
            ExpansionState::Failed => "failed",
        }
    }
}

/// A growth requested of a volume, kept in its record until done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expansion {
    /// The size asked for, bytes (the new `capacity_min`).
    pub bytes: u64,
    pub state: ExpansionState,
    /// Node that took it (`""` = none yet).
    #[serde(default)]
    pub node: String,
    /// Last error, redacted.
    #[serde(default)]
    pub error: String,
}

impl Expansion {
    /// A new request for `bytes`.
    pub fn requested(bytes: u64) -> Self {
        Self {
            bytes,
            state: ExpansionState::Requested,
            node: String::new(),
            error: String::new(),
        }
    }

    /// One line for `volume status`.
    pub fn describe(&self) -> String {
        let mut s = format!("expand to {} bytes: {}", self.bytes, self.state.as_str());
        if !self.node.is_empty() {
            s.push_str(&format!(" (node {})", self.node));
        }
        if !self.error.is_empty() {
            s.push_str(&format!(": {}", self.error));
        }
        s
    }
}

/// The item that marks a registered volume's record (`"true"`; absent otherwise).
pub const REGISTERED_ITEM: &str = "registered";

/// The cluster-wide record of one deferred volume. Its `Debug` shows secret keys, never values.
#[derive(Clone, PartialEq)]
pub struct VolumeRecord {
    /// UUID chosen at `volume create`; passed to plugins as DHV_VOLUME_ID.
    pub id: String,
    pub spec: VolumeSpec,
    /// Given to plugins as DHV_SECRETS for create, publish, unpublish and delete; never printed.
    pub secrets: BTreeMap<String, String>,
    pub state: VolumeState,
    /// What the plugin's `create` returned as `context`.
    pub context: serde_json::Value,
    /// What the plugin's `create` returned as `bytes`.
    pub capacity_bytes: u64,
    /// Node running `create` or `delete` right now; after a create, the node that ran it.
    pub worker_node: String,
    /// Last error of `create`/`delete`.
    pub error: String,
    /// A requested growth not yet applied (`volume create` again with a larger
    /// `capacity_min`, see the `expansion` module); `None` when there is none. Shown by
    /// `volume status`.
    pub expansion: Option<Expansion>,
    /// The variable's ModifyIndex, for check-and-set updates.
    pub modify_index: u64,
    /// The variable's CreateIndex (Nomad API: `GET /v1/var/:path`, `CreateIndex`): set by
    /// Nomad when the variable is first written and kept by every later write, so a record
    /// deleted and written again gets a new one. A delete signature binds it (no replay of a
    /// saved `deleting` record). 0 before the record is first written.
    pub create_index: u64,
    /// True for a volume `volume register` recorded (existing storage, no plugin `create`,
    /// item `registered`). Its context then comes from the operator and is signed with the
    /// spec (the `trust` module); plugins are told so (`DHV_CONTEXT_SIGNED`).
    pub registered: bool,
    /// The operator's signature over ID, place, spec and secrets (the `trust` module); empty when
    /// unsigned. Nodes copy it unchanged when they write the record back.
    pub signature: String,
    /// The operator's signature of the delete request; empty unless `volume delete` signed one.
    pub delete_signature: String,
    /// A publish failed with the class "final" (unsigned: [`final_failure`]); no node offers
    /// the volume while it is set.
    pub final_failure: Option<final_failure::FinalFailure>,
}

impl std::fmt::Debug for VolumeRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secrets: BTreeMap<&str, &str> = self
            .secrets
            .keys()
            .map(|k| (k.as_str(), "[redacted]"))
            .collect();
        f.debug_struct("VolumeRecord")
            .field("id", &self.id)
            .field("spec", &self.spec)
            .field("secrets", &secrets)
            .field("state", &self.state)
            .field("context", &self.context)
            .field("capacity_bytes", &self.capacity_bytes)
            .field("worker_node", &self.worker_node)
            .field("error", &self.error)
            .field("expansion", &self.expansion)
            .field("modify_index", &self.modify_index)
            .field("create_index", &self.create_index)
            .field("registered", &self.registered)
            .field("signed", &!self.signature.is_empty())
            .field("final_failure", &self.final_failure)
            .finish()
    }
}

/// The most a volume record may hold, in bytes of its variable's Items (keys plus values):
/// Nomad refuses a larger variable with 400 "variables are limited to 64KiB in total size"
/// (`nomad/structs/variables.go` `VariableDecrypted.Validate`, `maxVariableSize`).
pub const MAX_RECORD_BYTES: usize = 64 * 1024;

/// A volume record too big for one Nomad variable ([`MAX_RECORD_BYTES`]).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("volume record {volume} would be {bytes} bytes ({context} of them the plugin's context); Nomad holds at most 65536 bytes per variable: keep the plugin's context to identifiers and paths (not data), and the spec's parameters short")]
pub struct RecordTooBig {
    pub volume: VolumeKey,
    pub bytes: usize,
    pub context: usize,
}

/// A variable that is not a volume record dhv-binder wrote.
#[derive(Debug, thiserror::Error)]
#[error("variable {path} is not a dhv-binder volume record: {reason}")]
pub struct RecordError {
    pub path: String,
    pub reason: String,
}

/// Reads the items volume and snapshot records share: `secrets` (JSON object, absent = none),
/// `state` (a [`VolumeState`] name) and `context` (JSON, absent = `null`).
pub fn common_items(
    var: &Variable,
) -> Result<(BTreeMap<String, String>, VolumeState, serde_json::Value), RecordError> {
    let err = |reason: String| RecordError {
        path: var.path.clone(),
        reason,
    };
    let item = |k: &str| var.items.get(k).map(String::as_str).unwrap_or_default();
    let secrets = match item("secrets") {
        "" => BTreeMap::new(),
        s => serde_json::from_str(s).map_err(|e| err(format!("secrets: {e}")))?,
    };
    let state = serde_json::from_value(serde_json::Value::String(item("state").into()))
        .map_err(|e| err(format!("state: {e}")))?;
    let context = match item("context") {
        "" => serde_json::Value::Null,
        s => serde_json::from_str(s).map_err(|e| err(format!("context: {e}")))?,
    };
    Ok((secrets, state, context))
}

/// Encodes a volume name for a variable path (`[a-zA-Z0-9-_~/]` only): other bytes become `~xx`.
pub fn encode_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("~{b:02x}"));
        }
    }
    out
}

/// The variable path of a volume's record.
pub fn record_path(name: &str) -> String {
    format!("{RECORD_PREFIX}{}", encode_name(name))
}

impl VolumeRecord {
    /// A new record in state `pending`.
    pub fn new(spec: VolumeSpec, secrets: BTreeMap<String, String>) -> Self {
        Self {
            id: uuid::Uuid::new_v4().to_string(),
            spec,
            secrets,
            state: VolumeState::Pending,
            context: serde_json::Value::Null,
            capacity_bytes: 0,
            worker_node: String::new(),
            error: String::new(),
            expansion: None,
            modify_index: 0,
            create_index: 0,
            registered: false,
            signature: String::new(),
            delete_signature: String::new(),
            final_failure: None,
        }
    }

    /// `(namespace, name)`: how the volume is keyed everywhere (never by name alone).
    pub fn key(&self) -> VolumeKey {
        VolumeKey {
            namespace: self.spec.namespace.clone().into(),
            name: self.spec.name.clone().into(),
        }
    }

    /// The variable that stores this record.
    pub fn to_variable(&self) -> Variable {
        let mut items = BTreeMap::new();
        items.insert("id".into(), self.id.clone());
        items.insert(
            "spec".into(),
            serde_json::to_string(&self.spec).unwrap_or_default(),
        );
        items.insert(
            "secrets".into(),
            serde_json::to_string(&self.secrets).unwrap_or_default(),
        );
        items.insert("state".into(), self.state.as_str().into());
        items.insert("context".into(), self.context.to_string());
        items.insert("capacity_bytes".into(), self.capacity_bytes.to_string());
        items.insert("worker_node".into(), self.worker_node.clone());
        items.insert("error".into(), self.error.clone());
        if let Some(x) = &self.expansion {
            items.insert(
                "expansion".into(),
                serde_json::to_string(x).unwrap_or_default(),
            );
        }
        if self.registered {
            items.insert(REGISTERED_ITEM.into(), "true".into());
        }
        if let Some(f) = &self.final_failure {
            items.insert(final_failure::ITEM.into(), f.to_item());
        }
        for (k, v) in [
            ("signature", &self.signature),
            ("delete_signature", &self.delete_signature),
        ] {
            if !v.is_empty() {
                items.insert(k.into(), v.clone());
            }
        }
        Variable {
            namespace: self.spec.namespace.clone(),
            path: record_path(&self.spec.name),
            items,
            ..Default::default()
        }
    }

    /// Refuses a record whose variable Nomad would refuse as too big ([`MAX_RECORD_BYTES`],
    /// counted as Nomad does: the bytes of every item's key and value).
    pub fn check_size(&self) -> Result<(), RecordTooBig> {
        let bytes: usize = self
            .to_variable()
            .items
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum();
        if bytes <= MAX_RECORD_BYTES {
            return Ok(());
        }
        Err(RecordTooBig {
            volume: self.key(),
            bytes,
            context: self.context.to_string().len(),
        })
    }

    /// Reads a record back from its variable, re-validating what it holds.
    pub fn from_variable(var: &Variable) -> Result<Self, RecordError> {
        let err = |reason: String| RecordError {
            path: var.path.clone(),
            reason,
        };
        let item = |k: &str| var.items.get(k).cloned().unwrap_or_default();
        let spec: VolumeSpec =
            serde_json::from_str(&item("spec")).map_err(|e| err(format!("spec: {e}")))?;
        validate_identifier("name", &spec.name, true).map_err(|e| err(e.to_string()))?;
        validate_identifier("plugin_id", &spec.plugin_id, false).map_err(|e| err(e.to_string()))?;
        validate_identifier("namespace", &spec.namespace, false).map_err(|e| err(e.to_string()))?;
        if spec.namespace != var.namespace {
            return Err(err(format!(
                "spec namespace {} differs from the variable's {}",
                spec.namespace, var.namespace
            )));
        }
        if var.path != record_path(&spec.name) {
            return Err(err(format!(
                "spec name {:?} belongs at {}, not here (a record copied to another path)",
                spec.name,
                record_path(&spec.name)
            )));
        }
        let (secrets, state, context) = common_items(var)?;
        let expansion = match item("expansion").as_str() {
            "" => None,
            s => Some(serde_json::from_str(s).map_err(|e| err(format!("expansion: {e}")))?),
        };
        let id = item("id");
        if uuid::Uuid::parse_str(&id).is_err() {
            return Err(err(format!("id {id:?} is not a UUID")));
        }
        Ok(Self {
            id,
            spec,
            secrets,
            state,
            context,
            capacity_bytes: item("capacity_bytes").parse().unwrap_or(0),
            worker_node: item("worker_node"),
            error: item("error"),
            expansion,
            modify_index: var.modify_index,
            create_index: var.create_index,
            registered: item(REGISTERED_ITEM) == "true",
            signature: item("signature"),
            delete_signature: item("delete_signature"),
            final_failure: final_failure::FinalFailure::from_item(&item(final_failure::ITEM))
                .map_err(err)?,
        })
    }

    /// The cluster-wide access mode (the first capability's).
    pub fn access_mode(&self) -> &str {
        self.spec
            .capabilities
            .first()
            .map(|c| c.access_mode.as_str())
            .unwrap_or("single-node-writer")
    }

    /// Capabilities for the node-local placeholder: Nomad's host volumes accept only
    /// single-node-* modes, so multi-node-* map to their single-node counterparts.
    pub fn placeholder_capabilities(&self) -> Vec<crate::nomad::types::Capability> {
        let mut caps: Vec<_> = self
            .spec
            .capabilities
            .iter()
            .map(|c| crate::nomad::types::Capability {
                attachment_mode: c.attachment_mode.clone(),
                access_mode: match c.access_mode.as_str() {
                    "multi-node-reader-only" => "single-node-reader-only".into(),
                    "multi-node-multi-writer" => "single-node-multi-writer".into(),
                    other => other.into(),
                },
            })
            .collect();
        // A writer volume also serves read-only requests.
        let extra: Vec<_> = caps
            .iter()
            .filter(|c| c.access_mode != "single-node-reader-only")
            .map(|c| crate::nomad::types::Capability {
                attachment_mode: c.attachment_mode.clone(),
                access_mode: "single-node-reader-only".into(),
            })
            .collect();
        caps.extend(extra);
        caps.sort();
        caps.dedup();
        caps
    }
}

/// How volumes are keyed: by namespace and name together (two namespaces may both have a
/// volume called `data`). The strings are shared: a clone (the journal, the view, the usage
/// task and the status each key their maps by it) copies two pointers, not the strings
/// (docs/scale.md, memory per allocation). Serialised as two strings.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct VolumeKey {
    pub namespace: std::sync::Arc<str>,
    pub name: std::sync::Arc<str>,
}

impl VolumeKey {
    /// `<namespace>/<name>` as a relative path, after validating both (no `/`, `..`, NUL or
    /// leading `.`/`-`): the only way a key may reach a filesystem path.
    pub fn relative_path(&self) -> Result<std::path::PathBuf, SpecError> {
        validate_identifier("namespace", &self.namespace, false)?;
        validate_identifier("name", &self.name, true)?;
        Ok(std::path::Path::new(&*self.namespace).join(&*self.name))
    }
}

impl std::fmt::Display for VolumeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// Issue 37 #15: each error that names a place in the spec gives its line, and
    /// `located` prints it as `<source>:<line>: …`.
    #[test]
    fn spec_errors_name_their_line() {
        let head = "name = \"data\"\ntype = \"host\"\nplugin_id = \"bind\"\n\ncapability {\n  access_mode = \"single-node-writer\"\n";
        let cases: [(&str, &str); 6] = [
            (
                "  attachment_mod = \"file-system\"\n}\n",
                "spec.hcl:7: \"attachment_mod\" is not a field of a capability block",
            ),
            (
                "  attachment_mode = \"floppy\"\n}\n",
                "spec.hcl:7: attachment_mode \"floppy\" is not one of",
            ),
            (
                "  attachment_mode = 7\n}\n",
                "spec.hcl:7: capability.attachment_mode must be a string",
            ),
            (
                "  attachment_mode = \n}\n",
                "spec.hcl:7:21: not valid HCL: invalid expression",
            ),
            (
                "}\nparameters = 5\n",
                "spec.hcl:8: parameters must be a block",
            ),
            (
                "}\n\n\n\nnode_id = \"n1\"\n",
                "spec.hcl:11: node_id is not supported",
            ),
        ];
        for (body, want) in cases {
            let text = format!("{head}{body}");
            let e = parse_spec(&text).unwrap_err();
            let shown = e.located("spec.hcl", &text);
            assert!(shown.starts_with(want), "{shown}\n(wanted {want})");
        }
        // Two capability blocks: the line of the bad one.
        let text = "name = \"d\"\nplugin_id = \"bind\"\ncapability {\n  access_mode = \"single-node-writer\"\n}\ncapability {\n  access_mode = \"sometimes\"\n}\n";
        let e = parse_spec(text).unwrap_err();
        assert_eq!(e.line_in(text), Some(7), "{e}");
        // Top-level fields after comments and blank lines.
        let text = "# a comment\n\nname = \"d\"\n/* two\nlines */\nplugin_id = \"b/ad\"\n";
        let e = parse_spec(text).unwrap_err();
        assert_eq!(
            e.located("<stdin>", text).split(": ").next(),
            Some("<stdin>:6")
        );
        // An error about the spec as a whole names the file only.
        let e = parse_spec("plugin_id = \"bind\"\n").unwrap_err();
        assert_eq!(e.located("v.hcl", ""), "v.hcl: name is required");
    }

    const SPEC: &str = r#"
        name      = "shared-data"
        type      = "host"
        namespace = "default"
        plugin_id = "bind"
        capacity_min = "1GiB"
        capacity_max = 2147483648
        capability {
          access_mode     = "single-node-writer"
          attachment_mode = "file-system"
        }
        parameters { export = "/srv/exports" }
        secrets { password = "hunter2" }
    "#;

    #[test]
    fn parses_a_full_spec() {
        let (spec, secrets) = parse_spec(SPEC).unwrap();
        assert_eq!(spec.name, "shared-data");
        assert_eq!(spec.plugin_id, "bind");
        assert_eq!(spec.capacity_min, 1 << 30);
        assert_eq!(spec.capacity_max, 2 << 30);
        assert_eq!(spec.parameters["export"], "/srv/exports");
        assert_eq!(secrets["password"], "hunter2");
        assert_eq!(spec.capabilities[0].access_mode, "single-node-writer");
    }

    #[test]
    fn rejects_traversal_and_bad_values() {
        for (text, field) in [
            ("name = \"../../etc\"\nplugin_id = \"bind\"", "name"),
            ("name = \"a\"\nplugin_id = \"../../bin/sh\"", "plugin_id"),
            (
                "name = \"a\"\nplugin_id = \"bind\"\nnamespace = \"x/y\"",
                "namespace",
            ),
            ("name = \"a\\nb\"\nplugin_id = \"bind\"", "name"),
            ("name = \"a\\u0000b\"\nplugin_id = \"bind\"", "name"),
        ] {
            match parse_spec(text) {
                Err(SpecError::BadIdentifier { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(
            parse_spec("name = \"a\"\nplugin_id = \"p\"\ntype = \"csi\""),
            Err(SpecError::BadType(_))
        ));
        assert!(matches!(
            parse_spec(
                "name = \"a\"\nplugin_id = \"p\"\ncapability {\n access_mode = \"everyone\"\n}"
            ),
            Err(SpecError::BadAccessMode(_))
        ));
        assert!(matches!(
            parse_spec("name = \"a\"\nplugin_id = \"p\"\ncapacity_min = \"lots\""),
            Err(SpecError::BadSize { .. })
        ));
    }

    #[test]
    fn unknown_fields_and_constraints_are_refused_by_name() {
        let base = "name = \"a\"\nplugin_id = \"bind\"\n";
        match parse_spec(&format!("{base}capacity_minimum = \"1GiB\"")) {
            Err(SpecError::UnknownField { field, known }) => {
                assert_eq!(field, "capacity_minimum");
                assert!(known.contains("capacity_min"), "{known}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse_spec(&format!(
                "{base}constraint {{\n  attribute = \"${{node.klass}}\"\n  value = \"db\"\n}}"
            )),
            Err(SpecError::Constraint(_))
        ));
        assert_eq!(
            parse_spec(&format!("{base}node_id = \"x\"")),
            Err(SpecError::NodeId)
        );
        // topology_request takes only `required` and `preferred` (Nomad's CSI shape).
        let e = parse_spec(&format!("{base}topology_request {{\n  rack = \"r1\"\n}}")).unwrap_err();
        assert!(matches!(e, SpecError::Topology(_)) && e.to_string().contains("rack"));
        // A typo inside a capability block is refused too.
        let e = parse_spec(&format!(
            "{base}capability {{\n  access_mod = \"single-node-writer\"\n}}"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("access_mod"), "{e}");
        // `context` and `capacity` belong to a register spec only.
        let reg = format!("{base}capacity = \"1GiB\"\ncontext {{\n  export_path = \"/x\"\n}}");
        assert!(matches!(
            parse_spec(&reg),
            Err(SpecError::UnknownField { ref field, .. }) if field == "capacity"
        ));
        assert!(parse_register_spec(&reg).is_ok());
    }

    #[test]
    fn per_alloc_names_and_alloc_ids() {
        assert!(validate_identifier("name", "data[3]", true).is_ok());
        assert!(validate_identifier("name", "data[3]", false).is_err());
        assert!(validate_identifier("name", "data[]", true).is_err());
        assert!(validate_identifier("name", "data[x]", true).is_err());
        assert!(validate_identifier("name", "-rf", false).is_err());
        assert!(validate_identifier("name", ".hidden", false).is_err());
        assert_eq!(
            parse_spec("plugin_id = \"p\""),
            Err(SpecError::Missing { field: "name" })
        );
        assert!(is_alloc_id("5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70"));
        assert!(!is_alloc_id("../x"));
        assert!(!is_alloc_id("5B0E8F7A-2C4D-4E19-B6A3-9D8C1F2E4A70"));
    }

    #[test]
    fn a_record_over_64_kib_is_refused_and_says_why() {
        let mut rec = VolumeRecord::new(
            parse_spec("name = \"big\"\ntype = \"host\"\nplugin_id = \"bind\"\n")
                .unwrap()
                .0,
            BTreeMap::new(),
        );
        assert_eq!(rec.check_size(), Ok(()));
        rec.context = serde_json::json!({"blob": "x".repeat(MAX_RECORD_BYTES)});
        let e = rec.check_size().unwrap_err();
        assert!(
            e.bytes > MAX_RECORD_BYTES && e.context > MAX_RECORD_BYTES,
            "{e:?}"
        );
        assert!(e.to_string().contains("plugin's context"), "{e}");
    }

    #[test]
    fn record_round_trips_through_a_variable() {
        let (spec, secrets) = parse_spec(SPEC).unwrap();
        let mut rec = VolumeRecord::new(spec, secrets);
        rec.state = VolumeState::Ready;
        rec.context = serde_json::json!({"export_path": "/srv/exports/x"});
        let mut var = rec.to_variable();
        var.modify_index = 9;
        assert_eq!(var.path, "dhv-binder/volumes/shared-data");
        let back = VolumeRecord::from_variable(&var).unwrap();
        rec.modify_index = 9;
        assert_eq!(back, rec);
        assert_eq!(record_path("data[0]"), "dhv-binder/volumes/data~5b0~5d");
    }

    #[test]
    fn a_volume_may_start_from_one_snapshot_or_one_clone() {
        let base = "name = \"b\"\nplugin_id = \"ext4\"\n";
        let snap = "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70";
        let (spec, _) = parse_spec(&format!("{base}snapshot_id = \"{snap}\"")).unwrap();
        assert_eq!(spec.source, VolumeSource::SnapshotId(snap.into()));
        let (spec, _) = parse_spec(&format!("{base}clone_id = \"a\"")).unwrap();
        assert_eq!(spec.source, VolumeSource::CloneId("a".into()));
        assert_eq!(
            parse_spec(&format!("{base}clone_id = \"a\"\nsnapshot_id = \"{snap}\"")),
            Err(SpecError::TwoSources)
        );
        assert!(matches!(
            parse_spec(&format!("{base}snapshot_id = \"../x\"")),
            Err(SpecError::BadSnapshotId(_))
        ));
        assert!(matches!(
            parse_spec(&format!("{base}clone_id = \"../x\"")),
            Err(SpecError::BadIdentifier {
                field: "clone_id",
                ..
            })
        ));
        // The source and a pending expansion survive the record's round trip; a record
        // written before either existed still reads.
        let mut rec = VolumeRecord::new(spec, BTreeMap::new());
        rec.expansion = Some(Expansion::requested(1 << 30));
        let var = rec.to_variable();
        assert_eq!(VolumeRecord::from_variable(&var).unwrap(), rec);
        let (plain, _) = parse_spec(base).unwrap();
        let mut var = VolumeRecord::new(plain, BTreeMap::new()).to_variable();
        assert!(
            !var.items["spec"].contains("source"),
            "{}",
            var.items["spec"]
        );
        var.items.remove("expansion");
        let back = VolumeRecord::from_variable(&var).unwrap();
        assert_eq!(
            (back.spec.source, back.expansion),
            (VolumeSource::Empty, None)
        );
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let deep = format!("name = {}1{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(parse_spec(&deep), Err(SpecError::TooDeep));
        let blocks = format!(
            "name = \"a\"\nplugin_id = \"p\"\n{}{}",
            "parameters {\n".repeat(40),
            "}\n".repeat(40)
        );
        assert_eq!(parse_spec(&blocks), Err(SpecError::TooDeep));
        // Brackets inside strings and comments do not count.
        let quoted = format!(
            "name = \"a\"\nplugin_id = \"p\"\n# {}\nparameters {{ x = \"{}\\\"\" }}",
            "{".repeat(100),
            "[".repeat(100)
        );
        assert!(parse_spec(&quoted).is_ok(), "{quoted}");
        assert_eq!(nesting::depth("a { b { c = [1] } } // {{{{\n/* [[[[ */"), 3);
    }

    #[test]
    fn debug_hides_secret_values() {
        let (spec, secrets) = parse_spec(SPEC).unwrap();
        let rec = VolumeRecord::new(spec, secrets);
        let shown = format!("{rec:?} {rec:#?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("password"), "{shown}");
    }

    #[test]
    fn a_record_copied_to_another_path_or_namespace_is_refused() {
        let (spec, secrets) = parse_spec(SPEC).unwrap();
        let rec = VolumeRecord::new(spec, secrets);
        let mut var = rec.to_variable();
        var.path = "dhv-binder/volumes/other".into();
        let e = VolumeRecord::from_variable(&var).unwrap_err().to_string();
        assert!(e.contains("copied to another path"), "{e}");
        let mut var = rec.to_variable();
        var.namespace = "prod".into();
        assert!(VolumeRecord::from_variable(&var).is_err());
        // Signatures survive the round trip a node's write-back makes.
        let mut signed = rec.clone();
        signed.signature = "ed25519:ab:cd".into();
        signed.delete_signature = "ed25519:ab:ef".into();
        let back = VolumeRecord::from_variable(&signed.to_variable()).unwrap();
        assert_eq!(back.signature, signed.signature);
        assert_eq!(back.delete_signature, signed.delete_signature);
    }

    #[test]
    fn keys_reach_paths_only_when_valid() {
        let k = |ns: &str, name: &str| VolumeKey {
            namespace: ns.into(),
            name: name.into(),
        };
        assert_eq!(
            k("default", "data[0]").relative_path().unwrap(),
            std::path::PathBuf::from("default/data[0]")
        );
        for (ns, name) in [
            ("..", "x"),
            ("a/b", "x"),
            ("", "x"),
            ("ns", "../x"),
            ("ns", "/etc"),
            ("ns\0", "x"),
        ] {
            assert!(k(ns, name).relative_path().is_err(), "{ns:?} {name:?}");
        }
    }
}
