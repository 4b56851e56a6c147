//! The mount table (`/proc/<pid>/mountinfo`), read as bytes: which mounts stand where, from
//! which device and root. A journal record that says "published" is checked against it.
//!
//! The host's table is pid 1's ([`MountTable::read`]); the agent refuses to run in any
//! other mount namespace (see the `host` module). A table that cannot be read or parsed is an
//! error, never an empty table. Whether one mount is in use is asked of the kernel in
//! [`busy`].

pub mod busy;
pub mod changes;
pub mod unchanged;

use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use changes::MountChanges;

/// pid 1's mount table: the host's mount namespace.
pub const HOST_MOUNTINFO: &str = "/proc/1/mountinfo";
/// This process's mount table.
pub const SELF_MOUNTINFO: &str = "/proc/self/mountinfo";

/// The host's table as [`MountTable::read`] last read it, with the descriptor it polls.
static HOST: unchanged::Unchanged = unchanged::Unchanged::new();

/// Why a mount table could not be had.
#[derive(Debug, thiserror::Error)]
pub enum MountsError {
    /// Reading the file failed (ENOENT: the process is gone; EACCES: not root).
    #[error(
        "cannot read the mount table {path}: {source} (dhv-binder must run as root on the host)"
    )]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line is not in the kernel's mountinfo format (proc(5)).
    #[error("{path} line {line}: {reason}: {text:?}")]
    Malformed {
        path: PathBuf,
        line: usize,
        reason: &'static str,
        text: String,
    },
    /// Waiting for a change of the table failed.
    #[error("cannot watch the mount table {path}: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A device number (`st_dev`, mountinfo field 3 `major:minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceId {
    pub major: u32,
    pub minor: u32,
}

impl DeviceId {
    /// The device of a `stat` result (`st_dev`).
    pub fn from_dev(dev: u64) -> Self {
        Self {
            major: nix::sys::stat::major(dev) as u32,
            minor: nix::sys::stat::minor(dev) as u32,
        }
    }
}

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// One line of mountinfo (proc(5)). Paths keep their bytes (escapes decoded), so a mount
/// point that is not UTF-8 is kept exactly.
///
/// The five strings share one allocation (a table keeps one entry per mount of the node,
/// and a reading after a burst keeps one per published volume): 64 bytes and one
/// allocation per mount instead of 152 bytes and five (`memory_budget`).
#[derive(Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Mount ID (unique across all mount namespaces while the mount exists).
    pub id: u32,
    /// Mount ID of the parent mount.
    pub parent: u32,
    /// Device of the mounted filesystem.
    pub dev: DeviceId,
    /// The peer group this mount is shared in (`shared:N`), if it is shared.
    pub shared: Option<u32>,
    /// The peer group this mount is a slave of (`master:N`), if it is a slave.
    pub master: Option<u32>,
    /// root, mount point, options, type and source, one after another.
    text: Box<[u8]>,
    /// Where each of the first four ends in `text` (the source runs to the end).
    ends: [u32; 4],
}

/// The strings of a [`MountEntry`], as [`MountEntry::new`] takes them.
#[derive(Debug, Clone, Copy)]
pub struct MountText<'a> {
    /// The directory of the filesystem mounted here.
    pub root: &'a Path,
    /// Where it is mounted.
    pub mount_point: &'a Path,
    /// Per-mount options.
    pub options: &'a str,
    /// Filesystem type, with subtype.
    pub fs_type: &'a str,
    /// Filesystem source.
    pub source: &'a str,
}

impl std::fmt::Debug for MountEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountEntry")
            .field("id", &self.id)
            .field("parent", &self.parent)
            .field("dev", &self.dev)
            .field("root", &self.root())
            .field("mount_point", &self.mount_point())
            .field("options", &self.options())
            .field("fs_type", &self.fs_type())
            .field("source", &self.source())
            .field("shared", &self.shared)
            .field("master", &self.master)
            .finish()
    }
}

impl MountEntry {
    /// An entry of mount `id` (parent `parent`, device `dev`, peer groups `shared` and
    /// `master`) with the strings of `text`.
    pub fn new(
        id: u32,
        parent: u32,
        dev: DeviceId,
        text: MountText<'_>,
        shared: Option<u32>,
        master: Option<u32>,
    ) -> Self {
        let parts: [&[u8]; 5] = [
            text.root.as_os_str().as_bytes(),
            text.mount_point.as_os_str().as_bytes(),
            text.options.as_bytes(),
            text.fs_type.as_bytes(),
            text.source.as_bytes(),
        ];
        let mut all = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        let mut ends = [0u32; 4];
        for (i, p) in parts.iter().enumerate() {
            all.extend_from_slice(p);
            if let Some(end) = ends.get_mut(i) {
                *end = end_of(&all);
            }
        }
        Self::of_buffer(id, parent, dev, (shared, master), all, ends)
    }

    /// An entry whose five strings are `all`, the first four ending at `ends`.
    fn of_buffer(
        id: u32,
        parent: u32,
        dev: DeviceId,
        (shared, master): (Option<u32>, Option<u32>),
        mut all: Vec<u8>,
        ends: [u32; 4],
    ) -> Self {
        all.shrink_to_fit();
        Self {
            id,
            parent,
            dev,
            shared,
            master,
            text: all.into_boxed_slice(),
            ends,
        }
    }

    /// The strings of this entry.
    pub fn text(&self) -> MountText<'_> {
        MountText {
            root: self.root(),
            mount_point: self.mount_point(),
            options: self.options(),
            fs_type: self.fs_type(),
            source: self.source(),
        }
    }

    /// The bytes of string `i` (0 root … 4 source).
    fn part(&self, i: usize) -> &[u8] {
        let start = match i {
            0 => 0,
            _ => self.ends.get(i - 1).map_or(0, |e| *e as usize),
        };
        let end = self.ends.get(i).map_or(self.text.len(), |e| *e as usize);
        self.text.get(start..end).unwrap_or_default()
    }

    /// String `i` as text: each was a `&str` when [`MountEntry::new`] joined them.
    fn part_str(&self, i: usize) -> &str {
        std::str::from_utf8(self.part(i)).unwrap_or_default()
    }

    /// The directory of that filesystem mounted here (`/` unless a bind of a subdirectory).
    pub fn root(&self) -> &Path {
        Path::new(OsStr::from_bytes(self.part(0)))
    }

    /// Where it is mounted, relative to the reading process's root.
    pub fn mount_point(&self) -> &Path {
        Path::new(OsStr::from_bytes(self.part(1)))
    }

    /// Per-mount options (`rw`/`ro`, `nosuid`, ...).
    pub fn options(&self) -> &str {
        self.part_str(2)
    }

    /// Filesystem type, with subtype (`fuse.sshfs`).
    pub fn fs_type(&self) -> &str {
        self.part_str(3)
    }

    /// Filesystem source (device, `server:/export`, `none`), lossily decoded.
    pub fn source(&self) -> &str {
        self.part_str(4)
    }

    /// This entry with `text`'s strings instead of its own.
    pub fn with_text(&self, text: MountText<'_>) -> Self {
        Self::new(
            self.id,
            self.parent,
            self.dev,
            text,
            self.shared,
            self.master,
        )
    }

    /// True when the mount (not only the filesystem) is read-only.
    pub fn read_only(&self) -> bool {
        self.options().split(',').any(|o| o == "ro")
    }

    /// What identifies this mount's content: device and root.
    pub fn identity(&self) -> MountIdentity {
        MountIdentity {
            dev: self.dev,
            root: self.root().into(),
            fs_type: self.fs_type().into(),
            source: self.source().into(),
        }
    }

    /// True when this mount shows `id`'s content or part of it: same device, and a root at
    /// or below its root (a bind of a subdirectory of the volume counts).
    pub fn shows(&self, id: &MountIdentity) -> bool {
        self.dev == id.dev && self.root().starts_with(&id.root)
    }
}

/// What a publish established at a target: the mounted filesystem's device, root, type and
/// source. Two mounts with the same identity show the same directory of the same
/// filesystem. Type and source count too: anonymous device numbers (NFS, FUSE, tmpfs) are
/// reused as soon as they are freed, so a foreign tmpfs mounted after the volume's NFS
/// mount went may get its number. (A loop device reused by another image of the same type
/// would still look the same; the journal keeps the image, see the ext4 plugin.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountIdentity {
    pub dev: DeviceId,
    pub root: Box<Path>,
    /// Kept in place up to 24 bytes, as the type and most sources are (`ext4`,
    /// `/dev/loop3`): each published volume's record holds one identity (docs/scale.md,
    /// memory per allocation).
    pub fs_type: compact_str::CompactString,
    pub source: compact_str::CompactString,
}

impl MountIdentity {
    /// The identity [`MountTable::from_points`] gives the mount at `path`.
    pub fn of_point(path: &Path) -> Self {
        Self {
            dev: DeviceId { major: 0, minor: 0 },
            root: Path::new("/").into(),
            fs_type: "tmpfs".into(),
            source: path.display().to_string().into(),
        }
    }

    /// True when `entry` mounts exactly this content (device, root, type and source equal).
    pub fn is(&self, entry: &MountEntry) -> bool {
        entry.dev == self.dev
            && entry.root() == &*self.root
            && entry.fs_type() == self.fs_type
            && entry.source() == self.source
    }
}

impl std::fmt::Display for MountIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} (device {}, root {})",
            self.fs_type,
            self.source,
            self.dev,
            self.root.display()
        )
    }
}

/// What stands at a target, compared with what its publish established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetState {
    /// Nothing is mounted at the target.
    Unmounted,
    /// Exactly one mount, and it shows the expected content.
    Published { mount_id: u32 },
    /// Exactly one mount, of something else: never accepted as the volume.
    Foreign { found: MountIdentity },
    /// More than one mount stacked at the target (`top` is what a task would see).
    Stacked { count: usize, top: MountIdentity },
}

struct Inner {
    entries: Vec<MountEntry>,
    /// Indexes into `entries`, sorted by the mount point's bytes and, for one mount point,
    /// in table order (the last one is usually on top; [`MountTable::top_at`] follows the
    /// parent links to be sure). Byte order keeps every path with a given prefix together,
    /// so a lookup is a binary search, and building it compares bytes, not components
    /// (a reading after every plugin call builds one: docs/scale.md).
    by_point: Vec<u32>,
}

/// The bytes of entry `i`'s mount point (empty past the end): the index's key.
fn point_of(entries: &[MountEntry], i: u32) -> &[u8] {
    entries.get(i as usize).map_or(&[][..], |e| e.part(1))
}

impl Inner {
    fn point(&self, i: u32) -> &[u8] {
        point_of(&self.entries, i)
    }

    /// The part of `by_point` whose mount points start with the bytes `prefix`.
    fn with_prefix(&self, prefix: &[u8]) -> &[u32] {
        let lo = self.by_point.partition_point(|&i| self.point(i) < prefix);
        let len = self.by_point[lo..].partition_point(|&i| self.point(i).starts_with(prefix));
        &self.by_point[lo..lo + len]
    }

    /// The part of `by_point` whose mount point is `path` (normalised): the start of the
    /// part that has `path` as a prefix, since a path sorts before its extensions.
    fn exactly(&self, path: &[u8]) -> &[u32] {
        let with = self.with_prefix(path);
        &with[..with.partition_point(|&i| self.point(i) == path)]
    }
}

/// `path` as the kernel writes a mount point: no empty or `.` components, no trailing
/// slash. `Path` compares by components, so `/a/b/` and `/a//b` name the mount point
/// `/a/b`; a byte index needs the one spelling.
fn normal(path: &Path) -> std::borrow::Cow<'_, Path> {
    let b = path.as_os_str().as_bytes();
    let plain = !b.windows(2).any(|w| w == b"//")
        && !b.windows(3).any(|w| w == b"/./")
        && !b.ends_with(b"/.")
        && (b.len() <= 1 || !b.ends_with(b"/"))
        && b != b".";
    if plain {
        std::borrow::Cow::Borrowed(path)
    } else {
        std::borrow::Cow::Owned(path.components().collect())
    }
}

/// A snapshot of one mount namespace's table. Cloning is cheap (shared); lookups by path
/// are logarithmic in the number of mounts.
#[derive(Clone)]
pub struct MountTable {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MountTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.inner.entries.iter()).finish()
    }
}

impl Default for MountTable {
    fn default() -> Self {
        Self::from_entries(Vec::new())
    }
}

impl MountTable {
    /// The host's table: pid 1's mount namespace ([`HOST_MOUNTINFO`]). What the agent plans
    /// from: a mount only the agent's own namespace shows is no mount for Nomad's tasks.
    /// Read again only when the kernel reports a change since the last read, or that read
    /// is older than [`unchanged::MAX_AGE`]; else the last read's table, which is then the
    /// same as a new read ([`unchanged`]).
    pub fn read() -> Result<Self, MountsError> {
        HOST.current(Path::new(HOST_MOUNTINFO))
    }

    /// True when both are the same reading (one read answered twice from
    /// [`unchanged`]): nothing in the table changed between them.
    pub fn same_reading(&self, other: &MountTable) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The host's table for the agent's periodic check: like [`MountTable::read`], but an
    /// unchanged table is reused for up to [`unchanged::IDLE_MAX_AGE`].
    pub fn read_idle() -> Result<Self, MountsError> {
        HOST.current_within(Path::new(HOST_MOUNTINFO), unchanged::IDLE_MAX_AGE)
    }

    /// How many times [`MountTable::read`] has read the host's table since the agent
    /// started (not answered from the last reading): each reading costs the kernel's
    /// formatting and the agent's parsing of every mount on the node
    /// (`dhv_binder_mount_table_reads_total`).
    pub fn host_reads() -> u64 {
        HOST.reads()
    }

    /// This process's table ([`SELF_MOUNTINFO`]).
    pub fn read_self() -> Result<Self, MountsError> {
        Self::read_file(Path::new(SELF_MOUNTINFO))
    }

    /// The table of process `pid`'s mount namespace.
    pub fn read_pid(pid: u32) -> Result<Self, MountsError> {
        Self::read_file(&PathBuf::from(format!("/proc/{pid}/mountinfo")))
    }

    /// Reads and parses a mountinfo file.
    pub fn read_file(path: &Path) -> Result<Self, MountsError> {
        let bytes = std::fs::read(path).map_err(|source| MountsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&bytes, path)
    }

    /// Parses mountinfo bytes; `path` names the source in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, MountsError> {
        let mut entries = Vec::new();
        for (n, line) in bytes.split(|b| *b == b'\n').enumerate() {
            if line.is_empty() {
                continue;
            }
            let entry = parse_line(line).map_err(|reason| MountsError::Malformed {
                path: path.to_path_buf(),
                line: n + 1,
                reason,
                text: String::from_utf8_lossy(line).into_owned(),
            })?;
            entries.push(entry);
        }
        Ok(Self::from_entries(entries))
    }

    /// A table of the given entries (tests, fixtures).
    pub fn from_entries(mut entries: Vec<MountEntry>) -> Self {
        // Kept until the next change of the table: no room left from the parse's growth
        // (about 130 bytes per mount).
        entries.shrink_to_fit();
        for e in &mut entries {
            if let std::borrow::Cow::Owned(p) = normal(e.mount_point()) {
                let text = MountText {
                    mount_point: &p,
                    ..e.text()
                };
                *e = e.with_text(text);
            }
        }
        let mut by_point: Vec<u32> = (0..entries.len())
            .map(|i| u32::try_from(i).unwrap_or(u32::MAX))
            .collect();
        // Stable: one mount point's entries keep their table order.
        by_point.sort_by(|a, b| point_of(&entries, *a).cmp(point_of(&entries, *b)));
        Self {
            inner: Arc::new(Inner { entries, by_point }),
        }
    }

    /// A table with one tmpfs mount at each of `points` (tests of code that only asks
    /// whether a path is mounted). Each mount's identity depends on its path alone
    /// ([`MountIdentity::of_point`]), whatever else the table holds.
    pub fn from_points<I: IntoIterator<Item = PathBuf>>(points: I) -> Self {
        Self::from_entries(
            points
                .into_iter()
                .zip(1000u32..)
                .map(|(mount_point, id)| {
                    let i = MountIdentity::of_point(&mount_point);
                    let text = MountText {
                        root: &i.root,
                        mount_point: &mount_point,
                        options: "rw",
                        fs_type: &i.fs_type,
                        source: &i.source,
                    };
                    MountEntry::new(id, 1, i.dev, text, None, None)
                })
                .collect(),
        )
    }

    /// The mount points, in path order.
    pub fn points(&self) -> std::collections::BTreeSet<PathBuf> {
        self.inner
            .entries
            .iter()
            .map(|e| e.mount_point().to_path_buf())
            .collect()
    }

    /// Every mount, in table order.
    pub fn entries(&self) -> &[MountEntry] {
        &self.inner.entries
    }

    /// The mount with this ID.
    pub fn by_id(&self, id: u32) -> Option<&MountEntry> {
        self.inner.entries.iter().find(|e| e.id == id)
    }

    /// The mounts standing at `path` (stacked mounts each count), in table order.
    pub fn at(&self, path: &Path) -> impl Iterator<Item = &MountEntry> + '_ {
        self.inner
            .exactly(normal(path).as_os_str().as_bytes())
            .iter()
            .filter_map(|i| self.inner.entries.get(*i as usize))
    }

    /// How many mounts stand at `path`.
    pub fn count(&self, path: &Path) -> usize {
        self.inner
            .exactly(normal(path).as_os_str().as_bytes())
            .len()
    }

    /// True when something is mounted at `path`.
    pub fn contains(&self, path: &Path) -> bool {
        self.count(path) > 0
    }

    /// The mount a lookup of `path` finds: of the mounts at `path`, the one no other mount
    /// at `path` is mounted on.
    pub fn top_at(&self, path: &Path) -> Option<&MountEntry> {
        let here: Vec<&MountEntry> = self.at(path).collect();
        here.iter()
            .rev()
            .find(|e| !here.iter().any(|o| o.parent == e.id))
            .copied()
    }

    /// Mounts whose mount point is `root` or below it, a mount point before those below
    /// it (in byte order of their paths).
    pub fn under<'a>(&'a self, root: &Path) -> impl Iterator<Item = &'a MountEntry> + 'a {
        let root = normal(root).as_os_str().as_bytes().to_vec();
        let inner = &self.inner;
        inner
            .with_prefix(&root)
            .iter()
            .filter_map(|i| inner.entries.get(*i as usize))
            .filter(move |e| {
                let p = e.mount_point().as_os_str().as_bytes();
                p.len() == root.len() || root == b"/" || p.get(root.len()) == Some(&b'/')
            })
    }

    /// What stands at `target`, compared with what its publish established (`expected`,
    /// `None` when nothing was established yet: then any mount is foreign).
    pub fn target_state(&self, target: &Path, expected: Option<&MountIdentity>) -> TargetState {
        let count = self.count(target);
        let Some(top) = self.top_at(target) else {
            return TargetState::Unmounted;
        };
        if count > 1 {
            return TargetState::Stacked {
                count,
                top: top.identity(),
            };
        }
        match expected {
            Some(id) if id.is(top) => TargetState::Published { mount_id: top.id },
            _ => TargetState::Foreign {
                found: top.identity(),
            },
        }
    }

    /// The mount points where this table differs from `before` (a mount added, removed
    /// or changed there): O(mounts) with integer keys, so a reader can recheck only the
    /// paths a new reading can have changed. Two readings of one namespace only.
    pub fn changed_points(&self, before: &MountTable) -> BTreeSet<PathBuf> {
        let mut out = BTreeSet::new();
        if Arc::ptr_eq(&self.inner, &before.inner) {
            return out;
        }
        let old: HashMap<u32, &MountEntry> =
            before.inner.entries.iter().map(|e| (e.id, e)).collect();
        let mut seen: HashSet<u32> = HashSet::with_capacity(self.inner.entries.len());
        for e in &self.inner.entries {
            seen.insert(e.id);
            match old.get(&e.id) {
                Some(o) if *o == e => {}
                Some(o) => {
                    out.insert(o.mount_point().to_path_buf());
                    out.insert(e.mount_point().to_path_buf());
                }
                None => {
                    out.insert(e.mount_point().to_path_buf());
                }
            }
        }
        for e in &before.inner.entries {
            if !seen.contains(&e.id) {
                out.insert(e.mount_point().to_path_buf());
            }
        }
        out
    }

    /// Mount IDs of this table (two tables of one namespace share some).
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.inner.entries.iter().map(|e| e.id)
    }
}

/// Parses one mountinfo line:
/// `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`.
fn parse_line(line: &[u8]) -> Result<MountEntry, &'static str> {
    let mut f = line.split(|b| *b == b' ');
    let mut next = |what: &'static str| f.next().ok_or(what);
    let id = number(next("no mount ID")?).ok_or("bad mount ID")?;
    let parent = number(next("no parent ID")?).ok_or("bad parent ID")?;
    let dev = {
        let d = next("no major:minor")?;
        let colon = d.iter().position(|b| *b == b':').ok_or("bad major:minor")?;
        DeviceId {
            major: number(&d[..colon]).ok_or("bad major")?,
            minor: number(&d[colon + 1..]).ok_or("bad minor")?,
        }
    };
    // The five strings are decoded straight into the entry's one buffer.
    let mut all = Vec::with_capacity(line.len());
    let mut ends = [0u32; 4];
    unescape_into(next("no root")?, &mut all);
    ends[0] = end_of(&all);
    unescape_into(next("no mount point")?, &mut all);
    ends[1] = end_of(&all);
    text_into(next("no mount options")?, &mut all, false);
    ends[2] = end_of(&all);
    // Optional fields up to the separator: `shared:N`, `master:N`, `propagate_from:N`,
    // `unbindable` (proc(5)).
    let (mut shared, mut master) = (None, None);
    loop {
        let field = next("no ' - ' separator")?;
        if field == b"-" {
            break;
        }
        if let Some(n) = field.strip_prefix(b"shared:") {
            shared = Some(number(n).ok_or("bad shared peer group")?);
        } else if let Some(n) = field.strip_prefix(b"master:") {
            master = Some(number(n).ok_or("bad master peer group")?);
        }
    }
    text_into(next("no filesystem type")?, &mut all, true);
    ends[3] = end_of(&all);
    text_into(next("no source")?, &mut all, true);
    Ok(MountEntry::of_buffer(
        id,
        parent,
        dev,
        (shared, master),
        all,
        ends,
    ))
}

/// Where the strings in `all` end so far (a mountinfo line is one page at most, the
/// kernel's seq_file: far below `u32::MAX`).
fn end_of(all: &[u8]) -> u32 {
    u32::try_from(all.len()).unwrap_or(u32::MAX)
}

fn number(b: &[u8]) -> Option<u32> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Appends field `b` as text to `out`, its escapes decoded first when `escaped`: bytes
/// that are not UTF-8 are replaced (U+FFFD), as `String::from_utf8_lossy` does.
fn text_into(b: &[u8], out: &mut Vec<u8>, escaped: bool) {
    let start = out.len();
    if escaped {
        unescape_into(b, out);
    } else {
        out.extend_from_slice(b);
    }
    if let Some(added) = out.get(start..) {
        if std::str::from_utf8(added).is_err() {
            let lossy = String::from_utf8_lossy(added).into_owned();
            out.truncate(start);
            out.extend_from_slice(lossy.as_bytes());
        }
    }
}

/// Appends `field` to `out` with mountinfo's octal escapes decoded (`\040` space, `\011`
/// tab, `\012` newline, `\134` backslash); other bytes pass unchanged.
fn unescape_into(field: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while let Some(&b) = field.get(i) {
        if b == b'\\' {
            if let Some(oct) = field.get(i + 1..i + 4) {
                if oct.iter().all(|d| (b'0'..=b'7').contains(d)) {
                    let v = oct
                        .iter()
                        .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                    if let Ok(v) = u8::try_from(v) {
                        out.push(v);
                        i += 4;
                        continue;
                    }
                }
            }
        }
        out.push(b);
        i += 1;
    }
}

fn legacy_table() -> Option<MountTable> {
    match MountTable::read_self() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::error!(error = %e, "mount table unreadable");
            None
        }
    }
}

/// This process's mount points. Legacy: an unreadable table is logged and reads as empty;
/// new code takes a [`MountTable`] and handles the error.
pub fn mount_points() -> std::collections::BTreeSet<PathBuf> {
    legacy_table().map(|t| t.points()).unwrap_or_default()
}

/// How many mounts stand on `path` now. Legacy: an unreadable table is logged and reads
/// as 0; new code uses [`MountTable::count`].
pub fn mount_count(path: &Path) -> usize {
    legacy_table().map_or(0, |t| t.count(path))
}

/// True when `path` is a mount point now. Legacy: an unreadable table is logged and reads
/// as "not mounted"; new code uses [`MountTable::contains`].
pub fn is_mount_point(path: &Path) -> bool {
    legacy_table().is_some_and(|t| t.contains(path))
}

/// Mount points at or below `root`. Legacy: an unreadable table is logged and reads as
/// empty; new code uses [`MountTable::under`].
pub fn mounts_under(root: &Path) -> Vec<PathBuf> {
    legacy_table()
        .map(|t| {
            t.under(root)
                .map(|e| e.mount_point().to_path_buf())
                .collect()
        })
        .unwrap_or_default()
}

/// A temporary directory for tests that mount: on drop, every mount below it is
/// unmounted, deepest and newest first, even when the test failed.
#[cfg(test)]
pub(crate) mod scratch {
    use super::MountTable;
    use std::path::{Path, PathBuf};

    /// A test's scratch directory for real mounts, removed with every mount under it.
    ///
    /// Holds [`serial`] for its whole life: a test that makes a mount namespace copies every
    /// mount of the host at that moment, other tests' scratch mounts included, and a test that
    /// asserts "nobody holds this volume" would then see that copy as a holder.
    pub(crate) struct Scratch {
        dir: tempfile::TempDir,
        _serial: std::sync::MutexGuard<'static, ()>,
    }

    /// The lock that keeps mount tests of this test binary one at a time (see [`Scratch`]).
    /// A test that made a namespace and panicked leaves it poisoned; that is no reason to fail
    /// the next test, so the poison is ignored.
    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// In a mount namespace the calling thread has just made private: lazily unmounts
    /// (there only) every mount under the temporary directory, deepest first. Each is a copy
    /// of another test's mount, of this binary or of a test binary running beside it (the
    /// lanes of `scripts/test-lanes`), and a copy held would make that test's unmount see a
    /// holder, or its loop device stay busy (tests/support/namespace.rs does the same for the
    /// integration tests).
    pub(crate) fn drop_foreign_mounts_here() {
        let tmp = std::env::temp_dir();
        let Ok(t) = MountTable::read_file(Path::new("/proc/thread-self/mountinfo")) else {
            return;
        };
        let mut copies: Vec<PathBuf> = t
            .under(&tmp)
            .map(|e| e.mount_point().to_path_buf())
            .filter(|p| p != &tmp)
            .collect();
        copies.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in copies {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    impl Scratch {
        /// A shell snippet, run first in a new mount namespace (`unshare --mount`): lazily
        /// unmounts there every mount under the temporary directory but this scratch
        /// directory's, deepest first (see [`drop_foreign_mounts_here`]).
        pub(crate) fn drop_foreign_mounts(&self) -> String {
            let tmp = std::env::temp_dir();
            format!(
                r#"awk -v tmp='{tmp}/' -v keep='{keep}' 'index($5, tmp) == 1 && $5 != keep && index($5, keep "/") != 1 {{ print $5 }}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done; "#,
                tmp = tmp.display().to_string().trim_end_matches('/'),
                keep = self.dir.path().display(),
            )
        }

        pub(crate) fn new() -> Self {
            let _serial = serial();
            let dir = tempfile::Builder::new()
                .prefix("dhv-binder-unit-")
                .tempdir()
                .expect("a temporary directory");
            Self { dir, _serial }
        }

        pub(crate) fn path(&self) -> &Path {
            self.dir.path()
        }

        pub(crate) fn dir(&self, rel: &str) -> PathBuf {
            let p = self.dir.path().join(rel);
            std::fs::create_dir_all(&p).expect("a directory in the scratch dir");
            p
        }

        /// Mounts a fresh tmpfs at `rel` (created) and returns its path.
        pub(crate) fn tmpfs(&self, rel: &str) -> PathBuf {
            self.tmpfs_from("dhv-test", rel)
        }

        /// Mounts a fresh tmpfs with source `source` at `rel`.
        pub(crate) fn tmpfs_from(&self, source: &str, rel: &str) -> PathBuf {
            let p = self.dir(rel);
            nix::mount::mount(
                Some(source),
                &p,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=1m"),
            )
            .expect("mount tmpfs (tests run as root)");
            p
        }

        /// Bind-mounts `src` at `dst` the way container runtimes bind host volumes
        /// (`MS_BIND | MS_REC`).
        pub(crate) fn rbind(&self, src: &Path, dst: &Path) {
            std::fs::create_dir_all(dst).expect("bind target");
            nix::mount::mount(
                Some(src),
                dst,
                None::<&str>,
                nix::mount::MsFlags::MS_BIND | nix::mount::MsFlags::MS_REC,
                None::<&str>,
            )
            .expect("bind mount");
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            for _ in 0..8 {
                let Ok(t) = MountTable::read_self() else {
                    return;
                };
                let mut left: Vec<_> = t
                    .under(self.dir.path())
                    .map(|e| {
                        (
                            e.mount_point().components().count(),
                            e.id,
                            e.mount_point().to_path_buf(),
                        )
                    })
                    .collect();
                if left.is_empty() {
                    return;
                }
                left.sort();
                for (_, _, p) in left.into_iter().rev() {
                    if nix::mount::umount(&p).is_err() {
                        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::scratch::Scratch;
    use super::*;
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;

    /// Issue 10: a new reading is compared with the last by mount ID, so the agent rechecks
    /// only the targets where something was mounted, unmounted or changed.
    #[test]
    fn changed_points_are_where_mounts_came_went_or_changed() {
        let t = |p: &str| PathBuf::from(p);
        let before = MountTable::from_points([t("/a"), t("/b"), t("/c")]);
        assert!(before.changed_points(&before).is_empty());
        let same = MountTable::from_points([t("/a"), t("/b"), t("/c")]);
        assert!(
            same.changed_points(&before).is_empty(),
            "same IDs, same entries"
        );
        // IDs are given in order: /a keeps 1000, /b keeps 1001, /d takes 1002 (was /c's).
        let after = MountTable::from_points([t("/a"), t("/b"), t("/d")]);
        assert_eq!(
            after.changed_points(&before),
            BTreeSet::from([t("/c"), t("/d")]),
            "an ID now on another mount point touches both"
        );
        let fewer = MountTable::from_points([t("/a")]);
        assert_eq!(
            fewer.changed_points(&before),
            BTreeSet::from([t("/b"), t("/c")])
        );
        assert_eq!(
            before.changed_points(&fewer),
            BTreeSet::from([t("/b"), t("/c")])
        );
        let mut entries: Vec<MountEntry> = before.inner.entries.to_vec();
        entries[0] = entries[0].with_text(MountText {
            options: "ro",
            ..entries[0].text()
        });
        let remounted = MountTable::from_entries(entries);
        assert_eq!(remounted.changed_points(&before), BTreeSet::from([t("/a")]));
    }

    const SAMPLE: &[u8] = b"36 35 98:0 /mnt1 /mnt/parent\\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
37 36 0:5 / /proc rw - proc proc rw\n\
40 36 0:50 / /srv/t ro shared:7 master:2 - tmpfs guard ro\n\
41 40 0:51 /exports/v1 /srv/t rw - nfs4 server:/exports rw,vers=4.2\n";

    fn sample() -> MountTable {
        MountTable::parse(SAMPLE, Path::new("sample")).unwrap()
    }

    #[test]
    fn parses_fields_escapes_and_optional_fields() {
        let t = sample();
        let e = &t.entries()[0];
        assert_eq!((e.id, e.parent), (36, 35));
        assert_eq!(
            e.dev,
            DeviceId {
                major: 98,
                minor: 0
            }
        );
        assert_eq!(e.root(), Path::new("/mnt1"));
        assert_eq!(e.mount_point(), Path::new("/mnt/parent dir"));
        assert_eq!((e.fs_type(), e.source()), ("ext3", "/dev/root"));
        let g = t.by_id(40).unwrap();
        assert!(g.read_only());
        assert_eq!(g.fs_type(), "tmpfs");
        assert!(!t.entries()[1].read_only());
        // Propagation: shared in group 7 and a slave of group 2; a slave only; neither.
        assert_eq!((g.shared, g.master), (Some(7), Some(2)));
        assert_eq!((e.shared, e.master), (None, Some(1)));
        let p = t.by_id(37).unwrap();
        assert_eq!((p.shared, p.master), (None, None));
    }

    /// A test's private namespace drops its copies of the other tests' mounts under the
    /// temporary directory, and keeps the rest of the table.
    #[test]
    fn a_private_test_namespace_holds_no_copy_of_other_tests_mounts() {
        let s = Scratch::new();
        let other = s.tmpfs("other");
        let copy = other.clone();
        std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare");
            nix::mount::mount(
                None::<&str>,
                "/",
                None::<&str>,
                nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .expect("private");
            let here = Path::new("/proc/thread-self/mountinfo");
            assert!(MountTable::read_file(here).unwrap().contains(&copy));
            super::scratch::drop_foreign_mounts_here();
            let t = MountTable::read_file(here).unwrap();
            assert!(
                !t.contains(&copy),
                "the copy of another test's mount stayed"
            );
            assert!(t.contains(Path::new("/")), "the rest of the table stays");
        })
        .join()
        .expect("the namespace's thread");
        assert!(is_mount_point(&other), "the host's mount is untouched");
    }

    #[test]
    fn keeps_a_mount_point_that_is_not_utf8() {
        let text = b"50 1 0:60 / /srv/caf\xe9\\040x rw - tmpfs none rw\n";
        let t = MountTable::parse(text, Path::new("t")).unwrap();
        let want = PathBuf::from(OsString::from_vec(b"/srv/caf\xe9 x".to_vec()));
        assert!(t.contains(&want));
        // Type and source are text: bytes that are not UTF-8 are replaced, escapes first.
        let text = b"51 1 0:61 / /srv/b rw - fuse.x\\040y caf\xe9 rw\n";
        let t = MountTable::parse(text, Path::new("t")).unwrap();
        let e = t.top_at(Path::new("/srv/b")).unwrap();
        assert_eq!((e.fs_type(), e.source()), ("fuse.x y", "caf\u{FFFD}"));
        assert_eq!(e.root(), Path::new("/"));
        assert_eq!(e.options(), "rw");
    }

    #[test]
    fn a_malformed_line_is_an_error_not_a_shorter_table() {
        for bad in [
            &b"36 35 98:0 /a /b rw master:1 ext3 /dev/root rw\n"[..],
            b"x 35 98:0 /a /b rw - ext3 /dev/root rw\n",
            b"36 35 98 /a /b rw - ext3 /dev/root rw\n",
            b"36 35 98:0 /a\n",
            b"36 35 98:0 /a /b rw shared:x - ext3 /dev/root rw\n",
        ] {
            let err = MountTable::parse(bad, Path::new("t")).unwrap_err();
            assert!(
                matches!(err, MountsError::Malformed { line: 1, .. }),
                "{err}"
            );
        }
    }

    #[test]
    fn a_read_error_is_an_error() {
        let err = MountTable::read_file(Path::new("/proc/0/mountinfo")).unwrap_err();
        assert!(matches!(err, MountsError::Read { .. }));
    }

    #[test]
    fn top_of_a_stack_and_target_states() {
        let t = sample();
        let target = Path::new("/srv/t");
        assert_eq!(t.count(target), 2);
        assert_eq!(t.top_at(target).unwrap().id, 41);
        let nfs = t.by_id(41).unwrap().identity();
        assert!(matches!(
            t.target_state(target, Some(&nfs)),
            TargetState::Stacked { count: 2, .. }
        ));
        let one = MountTable::from_entries(vec![t.by_id(41).unwrap().clone()]);
        assert_eq!(
            one.target_state(target, Some(&nfs)),
            TargetState::Published { mount_id: 41 }
        );
        // Same device, other root: another directory of the server, not this volume.
        let mut other = nfs.clone();
        other.root = Path::new("/exports/v2").into();
        assert!(matches!(
            one.target_state(target, Some(&other)),
            TargetState::Foreign { .. }
        ));
        assert!(matches!(
            one.target_state(target, None),
            TargetState::Foreign { .. }
        ));
        assert_eq!(
            one.target_state(Path::new("/srv"), Some(&nfs)),
            TargetState::Unmounted
        );
    }

    #[test]
    fn under_lists_the_subtree_only() {
        let t = sample();
        let under: Vec<_> = t.under(Path::new("/srv")).map(|e| e.id).collect();
        assert_eq!(under, vec![40, 41]);
        assert_eq!(t.under(Path::new("/sr")).count(), 0);
    }

    /// The index compares bytes: a sibling whose name extends a mount point's (`/srv/t-2`,
    /// `/srv/t2`, which sort between `/srv/t` and `/srv/t/x`) is neither at nor under it,
    /// and a path spelt with a trailing slash or a doubled one names the same mount point,
    /// as `Path` equality has it.
    #[test]
    fn lookups_by_bytes_keep_path_semantics() {
        let points = [
            "/srv/t/x",
            "/srv/t2",
            "/srv/t",
            "/srv/t-2",
            "/",
            "/srv/t/x/y",
            "/srv",
        ];
        let t = MountTable::from_points(points.iter().map(PathBuf::from));
        let ids = |it: Vec<&MountEntry>| -> Vec<String> {
            let mut v: Vec<String> = it
                .iter()
                .map(|e| e.mount_point().display().to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            ids(t.under(Path::new("/srv/t")).collect()),
            ["/srv/t", "/srv/t/x", "/srv/t/x/y"]
        );
        assert_eq!(
            ids(t.under(Path::new("/srv/t/")).collect()),
            ids(t.under(Path::new("/srv/t")).collect())
        );
        assert_eq!(t.under(Path::new("/")).count(), points.len());
        assert_eq!(t.under(Path::new("/sr")).count(), 0);
        for spelling in ["/srv/t", "/srv/t/", "/srv//t", "/srv/./t"] {
            assert_eq!(t.count(Path::new(spelling)), 1, "{spelling}");
            assert!(t.top_at(Path::new(spelling)).is_some(), "{spelling}");
        }
        assert_eq!(t.count(Path::new("/srv/t-")), 0);
        assert_eq!(t.count(Path::new("/nowhere")), 0);
        // A fixture's mount point spelt loosely is kept as the kernel would write it.
        let loose = MountTable::from_points([PathBuf::from("/a//b/")]);
        assert_eq!(loose.count(Path::new("/a/b")), 1);
        // Stacked mounts keep their table order at one mount point.
        let mut stacked = t.entries().to_vec();
        let mut top = stacked[2].clone();
        top.id = 7;
        top.parent = stacked[2].id;
        stacked.push(top);
        let st = MountTable::from_entries(stacked);
        let at: Vec<u32> = st.at(Path::new("/srv/t")).map(|e| e.id).collect();
        assert_eq!(at, [t.entries()[2].id, 7]);
        assert_eq!(st.top_at(Path::new("/srv/t")).map(|e| e.id), Some(7));
    }

    /// Real mounts: a tmpfs, then a foreign tmpfs after it is gone, seen in the host table.
    #[test]
    fn real_mounts_published_then_foreign() {
        let s = Scratch::new();
        let target = s.tmpfs("t");
        let host = MountTable::read().unwrap();
        let ours = host.top_at(&target).unwrap().identity();
        assert_eq!(ours.fs_type, "tmpfs");
        assert!(matches!(
            host.target_state(&target, Some(&ours)),
            TargetState::Published { .. }
        ));
        nix::mount::umount(&target).unwrap();
        assert_eq!(
            MountTable::read()
                .unwrap()
                .target_state(&target, Some(&ours)),
            TargetState::Unmounted
        );
        // A foreign tmpfs may well get the freed anonymous device number: its source tells.
        s.tmpfs_from("foreign", "t");
        let now = MountTable::read().unwrap();
        assert!(
            matches!(
                now.target_state(&target, Some(&ours)),
                TargetState::Foreign { .. }
            ),
            "{:?} accepted as {ours}",
            now.top_at(&target)
        );
        // A bind of the target elsewhere shows the same content.
        let copy = s.path().join("copy");
        s.rbind(&target, &copy);
        let t = MountTable::read_self().unwrap();
        let now = t.top_at(&target).unwrap().identity();
        assert!(now.is(t.top_at(&copy).unwrap()));
    }
}
