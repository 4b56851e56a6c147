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

/// Reads this process's mount table. An unreadable table is empty (then every published
/// record looks unmounted and is published again, which plugins handle idempotently).
pub fn mount_points() -> BTreeSet<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| parse_mountinfo(&t))
        .unwrap_or_default()
}

/// How many mounts stand on `path` now (stacked mounts count separately).
pub fn mount_count(path: &Path) -> usize {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| {
            t.lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|p| Path::new(&unescape(p)) == path)
                .count()
        })
        .unwrap_or(0)
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
