//! The mount table (`/proc/self/mountinfo`): which placeholder paths really are mounted.
//! A journal record that says "published" is always checked against it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Decodes mountinfo's octal escapes (`\040` for space, `\011`, `\012`, `\134`).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let oct = &field[i + 1..(i + 4).min(field.len())];
            if oct.len() == 3 {
                if let Ok(v) = u8::from_str_radix(oct, 8) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text into the set of mount points (field 5).
pub fn parse_mountinfo(text: &str) -> BTreeSet<PathBuf> {
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .collect()
}

/// The mount table at one moment: every mount point, with how many mounts stand on it
/// (stacked mounts count separately). The agent core plans from this reading; the shell
/// reads it again when it can have changed (after a plugin call, on the tick).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountTable {
    points: std::collections::BTreeMap<PathBuf, usize>,
}

impl MountTable {
    /// Reads `/proc/self/mountinfo`. An unreadable table is an error, never an empty one.
    pub fn read() -> std::io::Result<Self> {
        std::fs::read_to_string("/proc/self/mountinfo").map(|t| Self::parse(&t))
    }

    /// Parses mountinfo text (field 5 of each line, with its octal escapes decoded).
    pub fn parse(text: &str) -> Self {
        let mut points = std::collections::BTreeMap::new();
        for p in text.lines().filter_map(|l| l.split(' ').nth(4)) {
            *points.entry(PathBuf::from(unescape(p))).or_insert(0) += 1;
        }
        Self { points }
    }

    /// A table holding exactly `points` (tests).
    pub fn from_points<I: IntoIterator<Item = PathBuf>>(points: I) -> Self {
        Self {
            points: points.into_iter().map(|p| (p, 1)).collect(),
        }
    }

    /// True when `path` is a mount point.
    pub fn contains(&self, path: &Path) -> bool {
        self.points.contains_key(path)
    }

    /// How many mounts stand on `path`.
    pub fn count(&self, path: &Path) -> usize {
        self.points.get(path).copied().unwrap_or(0)
    }

    /// The mount points, in order.
    pub fn points(&self) -> BTreeSet<PathBuf> {
        self.points.keys().cloned().collect()
    }
}

/// Reads this process's mount table. An unreadable table is empty (then every published
/// record looks unmounted and is published again, which plugins handle idempotently).
pub fn mount_points() -> BTreeSet<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| parse_mountinfo(&t))
        .unwrap_or_default()
}

/// How many mounts stand on `path` now (stacked mounts count separately).
pub fn mount_count(path: &Path) -> usize {
    MountTable::read().map(|t| t.count(path)).unwrap_or(0)
}

/// True when `path` is a mount point now.
pub fn is_mount_point(path: &Path) -> bool {
    mount_points().contains(path)
}

/// Mount points at or below `root`.
pub fn mounts_under(root: &Path) -> Vec<PathBuf> {
    mount_points()
        .into_iter()
        .filter(|p| p.starts_with(root))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo_with_escapes() {
        let text = "36 35 98:0 /mnt1 /mnt/parent\\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    37 36 0:5 / /proc rw - proc proc rw\n";
        let set = parse_mountinfo(text);
        assert!(set.contains(Path::new("/mnt/parent dir")));
        assert!(set.contains(Path::new("/proc")));
        assert!(is_mount_point(Path::new("/proc")));
    }
}
