//! The processes of one plugin call: its output read until it exits, what it leaves
//! behind (its process group, helpers holding its pipes), and its group killed at a timeout.

use crate::escape::escape_control;
use std::process::ExitStatus;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Between SIGTERM and SIGKILL of a timed-out call's process group.
const KILL_GRACE: Duration = Duration::from_secs(3);

/// A process left over from a plugin call, holding its stdout or stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub pid: i32,
    /// Its command name (`/proc/<pid>/comm`).
    pub comm: String,
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({})", self.pid, escape_control(&self.comm))
    }
}

/// How long output is still read once the plugin has exited: what it wrote is in the pipe
/// already, so only a pipe some other process still holds open waits this long.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(250);

/// Reads `r` into a buffer (keeping the first `limit` bytes, discarding the rest so the
/// writer never blocks) until EOF, or, once `exited` holds the plugin's exit time, until
/// [`DRAIN_AFTER_EXIT`] after it. Returns the bytes and whether the pipe was still held
/// open by someone else at that point.
pub(super) async fn read_output<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
    mut exited: tokio::sync::watch::Receiver<Option<Instant>>,
) -> (Vec<u8>, bool) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let exit_time = *exited.borrow();
        let n = match exit_time {
            Some(at) => {
                let until = tokio::time::Instant::from_std(at + DRAIN_AFTER_EXIT);
                match tokio::time::timeout_at(until, r.read(&mut chunk)).await {
                    Ok(n) => n,
                    Err(_) => return (buf, true),
                }
            }
            None => tokio::select! {
                n = r.read(&mut chunk) => n,
                changed = exited.changed() => {
                    if changed.is_err() {
                        // The waiter is gone: the call is over either way.
                        return (buf, false);
                    }
                    continue;
                }
            },
        };
        match n {
            Ok(0) | Err(_) => return (buf, false),
            Ok(n) => {
                let room = limit.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

/// The inode of the pipe behind `stdout`, to find who else holds it.
pub(super) fn pipe_inode(stdout: &tokio::process::ChildStdout) -> Option<u64> {
    use std::os::fd::AsRawFd;
    nix::sys::stat::fstat(stdout.as_raw_fd())
        .ok()
        .map(|st| st.st_ino)
}

/// Processes other than this one and outside process group `group` (the call's, killed
/// when it ends) with the pipe `inode` open (found in /proc/*/fd).
pub(super) fn holders_of_pipe(inode: u64, group: Option<u32>) -> Vec<Leftover> {
    let want = format!("pipe:[{inode}]");
    let me = std::process::id() as i32;
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me || group.is_some_and(|g| process_group(pid) == Some(g as i32)) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == want.as_str()));
        if holds {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            out.push(Leftover {
                pid,
                comm: comm.trim().to_string(),
            });
        }
    }
    out
}

/// The live processes (not zombies) of process group `group`, from /proc.
pub(super) fn group_members(group: i32) -> Vec<Leftover> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| process_group(*pid) == Some(group))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().next().map(|st| st != "Z"))
                })
                .unwrap_or(false)
        })
        .map(|pid| Leftover {
            pid,
            comm: std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .unwrap_or_default()
                .trim()
                .to_string(),
        })
        .collect()
}

/// The process group of `pid` (field 5 of /proc/<pid>/stat, after the command in
/// parentheses).
pub(super) fn process_group(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

pub(super) fn describe_leftover(found: &[Leftover]) -> String {
    found
        .iter()
        .map(Leftover::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) async fn kill_group(pid: u32) {
    use nix::sys::signal::{killpg, Signal};
    let pg = nix::unistd::Pid::from_raw(pid as i32);
    if killpg(pg, Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = Instant::now() + KILL_GRACE;
    while Instant::now() < deadline {
        // Signal 0 probes whether any process of the group is left.
        if killpg(pg, None).is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = killpg(pg, Signal::SIGKILL);
}

pub(super) fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}
