//! A volume's mount options (issue 49): the spec's
//! `mount_options { mount_flags = [...] fs_type = "..." }` (the shape of a Nomad CSI
//! volume spec), validated against an allow-list, and the flags every published mount
//! carries.
//!
//! Every published mount is `nosuid,nodev` unless the spec asks otherwise with `suid` or
//! `dev`: a task cannot bring a setuid binary or a device node through network storage onto
//! the node. The flags are stored in the signed volume record and given to the plugin's
//! `publish` as `DHV_MOUNT_FLAGS` (docs/plugin-protocol.md): the effective list, defaults
//! included, ready for `mount -o`. `fs_type` is for plugins that format
//! (`DHV_FS_TYPE`); a plugin that does not format, or not with that type, refuses it.
//!
//! Read-only is not a mount flag here: it comes from the volume's access mode
//! (`DHV_READ_ONLY`), so a writer volume is never made read-only by a flag nor a reader
//! volume writable.

use serde::{Deserialize, Serialize};

/// The `mount_flags` a spec may ask for, as `mount -o` spells them.
pub const KNOWN_FLAGS: [&str; 10] = [
    "nosuid",
    "suid",
    "nodev",
    "dev",
    "noexec",
    "exec",
    "noatime",
    "relatime",
    "strictatime",
    "nodiratime",
];

/// At most this many flags (the allow-list has fewer distinct meanings).
const MAX_FLAGS: usize = 16;

/// Why a volume's mount options were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MountOptionsError {
    /// A flag outside [`KNOWN_FLAGS`].
    #[error("mount_flags: {flag:?} is not a mount flag dhv-binder knows ({}); read-only comes from the access mode, not from a flag", KNOWN_FLAGS.join(", "))]
    Unknown { flag: String },
    /// Two flags that say opposite things (`suid` and `nosuid`, two atime modes).
    #[error("mount_flags: {a:?} and {b:?} contradict each other: keep one")]
    Contradiction { a: String, b: String },
    /// More than 16 flags.
    #[error("mount_flags: {count} flags given, at most {MAX_FLAGS}")]
    TooMany { count: usize },
    /// `fs_type` is not a filesystem type name.
    #[error("mount_options.fs_type {0:?} is not a filesystem type name (lower-case letters and digits, at most 32, e.g. \"ext4\")")]
    BadFsType(String),
}

/// A volume spec's `mount_options` block, validated. Stored in the signed record; both
/// fields empty when the spec has none (the record then omits the block). A record read
/// back is validated again (a flag outside the allow-list makes the record malformed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Unchecked")]
pub struct MountOptions {
    /// The flags the spec asked for, deduplicated, in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_flags: Vec<String>,
    /// The filesystem a formatting plugin makes; empty: the plugin's own choice.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub fs_type: String,
}

/// [`MountOptions`] as stored, before validation.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Unchecked {
    #[serde(default)]
    mount_flags: Vec<String>,
    #[serde(default)]
    fs_type: String,
}

impl TryFrom<Unchecked> for MountOptions {
    type Error = MountOptionsError;
    fn try_from(u: Unchecked) -> Result<Self, Self::Error> {
        Self::new(u.mount_flags, u.fs_type)
    }
}

impl MountOptions {
    /// True when the spec gave no mount options (the defaults apply).
    pub fn is_empty(&self) -> bool {
        self.mount_flags.is_empty() && self.fs_type.is_empty()
    }

    /// Validates `mount_flags` and `fs_type` as the spec gave them.
    ///
    /// Errors: [`MountOptionsError`] for a flag outside [`KNOWN_FLAGS`], contradicting flags,
    /// more than 16 flags, or an `fs_type` that is not `[a-z0-9]{1,32}`.
    pub fn new(mount_flags: Vec<String>, fs_type: String) -> Result<Self, MountOptionsError> {
        if mount_flags.len() > MAX_FLAGS {
            return Err(MountOptionsError::TooMany {
                count: mount_flags.len(),
            });
        }
        let mut flags: Vec<String> = Vec::new();
        for f in mount_flags {
            if !flags.contains(&f) {
                flags.push(f);
            }
        }
        MountFlags::parse(&flags)?;
        let fs_ok = fs_type.len() <= 32
            && fs_type
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if !fs_ok {
            return Err(MountOptionsError::BadFsType(fs_type));
        }
        Ok(Self {
            mount_flags: flags,
            fs_type,
        })
    }

    /// The effective flags (the spec's over the defaults).
    pub fn flags(&self) -> MountFlags {
        // Validated when made (by `new` or when read back).
        MountFlags::parse(&self.mount_flags).unwrap_or_default()
    }
}

/// How access times are kept (`mount -o` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Atime {
    NoAtime,
    RelAtime,
    StrictAtime,
}

impl Atime {
    fn name(self) -> &'static str {
        match self {
            Atime::NoAtime => "noatime",
            Atime::RelAtime => "relatime",
            Atime::StrictAtime => "strictatime",
        }
    }
}

/// The flags a published mount carries: `nosuid` and `nodev` unless asked otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountFlags {
    /// Setuid and setgid bits honoured (`suid`); default false (`nosuid`).
    pub suid: bool,
    /// Device nodes usable (`dev`); default false (`nodev`).
    pub dev: bool,
    /// Nothing executable from the mount (`noexec`).
    pub noexec: bool,
    /// The access-time mode, when one was asked for (else the filesystem's default).
    pub atime: Option<Atime>,
    /// No access times on directories (`nodiratime`).
    pub nodiratime: bool,
}

impl Default for MountFlags {
    /// `nosuid,nodev`.
    fn default() -> Self {
        Self {
            suid: false,
            dev: false,
            noexec: false,
            atime: None,
            nodiratime: false,
        }
    }
}

impl MountFlags {
    /// Parses flag names (from a spec, or `,`-separated from `DHV_MOUNT_FLAGS` split by the
    /// caller) over the defaults.
    ///
    /// Errors: a name outside [`KNOWN_FLAGS`] or two that contradict each other.
    pub fn parse<S: AsRef<str>>(names: &[S]) -> Result<Self, MountOptionsError> {
        let mut out = Self::default();
        let mut seen: Vec<&str> = Vec::new();
        let opposite = |f: &str| -> &[&'static str] {
            match f {
                "nosuid" => &["suid"],
                "suid" => &["nosuid"],
                "nodev" => &["dev"],
                "dev" => &["nodev"],
                "noexec" => &["exec"],
                "exec" => &["noexec"],
                "noatime" => &["relatime", "strictatime"],
                "relatime" => &["noatime", "strictatime"],
                "strictatime" => &["noatime", "relatime"],
                _ => &[],
            }
        };
        for n in names {
            let f = n.as_ref();
            if !KNOWN_FLAGS.contains(&f) {
                return Err(MountOptionsError::Unknown { flag: f.into() });
            }
            if let Some(other) = seen.iter().find(|s| opposite(f).contains(s)) {
                return Err(MountOptionsError::Contradiction {
                    a: (*other).into(),
                    b: f.into(),
                });
            }
            seen.push(f);
            match f {
                "suid" => out.suid = true,
                "dev" => out.dev = true,
                "noexec" => out.noexec = true,
                "noatime" => out.atime = Some(Atime::NoAtime),
                "relatime" => out.atime = Some(Atime::RelAtime),
                "strictatime" => out.atime = Some(Atime::StrictAtime),
                "nodiratime" => out.nodiratime = true,
                _ => {}
            }
        }
        Ok(out)
    }

    /// Parses `DHV_MOUNT_FLAGS`' form: names separated by `,` (empty: the defaults).
    pub fn parse_list(list: &str) -> Result<Self, MountOptionsError> {
        let names: Vec<&str> = list.split(',').filter(|s| !s.is_empty()).collect();
        Self::parse(&names)
    }

    /// The effective flags as `mount -o` takes them, `,`-separated: always `nosuid` or
    /// `suid`, `nodev` or `dev`, then `noexec`, the atime mode and `nodiratime` when asked
    /// (e.g. `nosuid,nodev,noexec`). This is `DHV_MOUNT_FLAGS`.
    pub fn to_list(&self) -> String {
        let mut v = vec![
            if self.suid { "suid" } else { "nosuid" },
            if self.dev { "dev" } else { "nodev" },
        ];
        if self.noexec {
            v.push("noexec");
        }
        if let Some(a) = self.atime {
            v.push(a.name());
        }
        if self.nodiratime {
            v.push("nodiratime");
        }
        v.join(",")
    }
}

impl std::fmt::Display for MountFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_list())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(flags: &[&str]) -> Result<MountOptions, MountOptionsError> {
        MountOptions::new(flags.iter().map(|s| s.to_string()).collect(), String::new())
    }

    #[test]
    fn the_defaults_are_nosuid_nodev_and_a_spec_adds_or_lifts_them() {
        assert_eq!(MountOptions::default().flags().to_list(), "nosuid,nodev");
        assert_eq!(
            opts(&["noexec"]).unwrap().flags().to_list(),
            "nosuid,nodev,noexec"
        );
        assert_eq!(
            opts(&["suid", "noatime", "nodiratime", "noatime"])
                .unwrap()
                .flags()
                .to_list(),
            "suid,nodev,noatime,nodiratime"
        );
        assert_eq!(opts(&["noexec", "noexec"]).unwrap().mount_flags, ["noexec"]);
        assert_eq!(
            MountFlags::parse_list("nosuid,nodev,noexec").unwrap(),
            opts(&["noexec"]).unwrap().flags()
        );
    }

    #[test]
    fn unknown_contradicting_and_read_only_flags_are_refused() {
        for bad in ["ro", "rw", "bind", "x-mount.mkdir", "noexec,nosuid", ""] {
            assert!(
                matches!(opts(&[bad]), Err(MountOptionsError::Unknown { .. })),
                "{bad}"
            );
        }
        assert_eq!(
            opts(&["nosuid", "suid"]),
            Err(MountOptionsError::Contradiction {
                a: "nosuid".into(),
                b: "suid".into()
            })
        );
        assert!(opts(&["noatime", "strictatime"]).is_err());
        assert!(opts(&["exec", "noexec"]).is_err());
        assert!(MountOptions::new(vec![], "ext4; rm".into()).is_err());
        assert!(MountOptions::new(vec![], "Ext4".into()).is_err());
        assert!(MountOptions::new(vec![], "ext4".into()).is_ok());
        assert!(MountFlags::parse_list("nosuid,ro").is_err());
        // A record read back is validated again.
        assert!(
            serde_json::from_str::<MountOptions>(r#"{"mount_flags":["suid","nosuid"]}"#).is_err()
        );
        assert!(serde_json::from_str::<MountOptions>(r#"{"mount_flags":["ro"]}"#).is_err());
        assert!(serde_json::from_str::<MountOptions>(r#"{"x":1}"#).is_err());
        assert_eq!(
            serde_json::from_str::<MountOptions>(r#"{"mount_flags":["noexec"]}"#).unwrap(),
            opts(&["noexec"]).unwrap()
        );
    }

    /// The spec's block (issue 49): parsed into the record, refused by name when it says
    /// something dhv-binder cannot honour, with the line of the fault.
    #[test]
    fn a_spec_s_mount_options_block_is_parsed_and_checked() {
        use crate::volume::{parse_spec, SpecError};
        let spec = |block: &str| format!("name = \"v\"\nplugin_id = \"bind\"\n{block}\n");
        let (s, _) = parse_spec(&spec("mount_options {\n  mount_flags = [\"noexec\"]\n}")).unwrap();
        assert_eq!(s.mount_options.mount_flags, ["noexec"]);
        assert_eq!(s.mount_options.flags().to_list(), "nosuid,nodev,noexec");
        let (s, _) = parse_spec(&spec("")).unwrap();
        assert!(s.mount_options.is_empty());
        assert_eq!(s.mount_options.flags().to_list(), "nosuid,nodev");
        // Without mount_options the record's spec is what it was (old signatures verify).
        assert!(!serde_json::to_string(&s).unwrap().contains("mount_options"));
        let (s, _) = parse_spec(&spec("mount_options {\n  fs_type = \"ext4\"\n}")).unwrap();
        assert_eq!(s.mount_options.fs_type, "ext4");

        let text = spec("mount_options {\n  mount_flags = [\"ro\"]\n}");
        let e = parse_spec(&text).unwrap_err();
        assert!(
            matches!(
                e,
                SpecError::MountOptions(MountOptionsError::Unknown { .. })
            ),
            "{e}"
        );
        assert!(e.to_string().contains("access mode"), "{e}");
        assert_eq!(e.line_in(&text), Some(4));
        let text = spec("mount_options {\n  mount_flags = \"noexec\"\n}");
        let e = parse_spec(&text).unwrap_err();
        assert!(matches!(e, SpecError::WrongShape { .. }), "{e}");
        assert_eq!(e.line_in(&text), Some(4));
        let e = parse_spec(&spec("mount_options {\n  options = [\"x\"]\n}")).unwrap_err();
        assert!(matches!(e, SpecError::UnknownBlockField { .. }), "{e}");
        let e = parse_spec(&spec("mount_options = { mount_flags = [] }")).unwrap_err();
        assert!(matches!(e, SpecError::WrongShape { .. }), "{e}");
        let e = parse_spec(&spec(
            "mount_options {\n  mount_flags = [\"suid\", \"nosuid\"]\n}",
        ))
        .unwrap_err();
        assert!(
            matches!(
                e,
                SpecError::MountOptions(MountOptionsError::Contradiction { .. })
            ),
            "{e}"
        );
    }
}
