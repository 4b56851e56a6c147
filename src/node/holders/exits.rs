//! Waiting for the processes a refused unpublish named to exit: the evidence an unpublish
//! waits on. Each is watched through a pidfd (`pidfd_open(2)`, Linux 5.3: readable once
//! the process has exited, whoever its parent is), so the retry follows the last exit at
//! once instead of the retry's backoff.
//!
//! A watch only brings a retry forward: the retry scans `/proc` again and decides from
//! what it finds. A pid that ended and was used again before its pidfd was opened makes
//! the watch wait on another process; the backoff's retry still comes.

use std::os::fd::OwnedFd;
use std::time::Duration;
use tokio::io::unix::AsyncFd;

/// At most this many processes of one refusal are watched (the retry scans them all).
pub const WATCHED_MAX: usize = 64;

/// How often processes are checked where pidfds cannot be opened (kernels before 5.3,
/// `ENOSYS`) or polled (a runtime without an I/O driver).
pub const POLL_EVERY: Duration = Duration::from_millis(250);

/// Returns once every process of `pids` (the first [`WATCHED_MAX`]) has exited. A pid with
/// no process now has exited already. Never fails: where a pidfd cannot be opened or
/// polled, `/proc/<pid>` is checked every [`POLL_EVERY`] instead.
pub async fn all_exited(pids: &[u32]) {
    let mut polled = Vec::new();
    let mut fds = Vec::new();
    for &pid in pids.iter().take(WATCHED_MAX) {
        // Sound: `AsyncFd` owns the `OwnedFd`, so the descriptor is neither closed nor
        // replaced while registered (the I/O-safety concern of tokio PR 8587). Its
        // replacement is `unsafe`, which this crate forbids.
        #[allow(deprecated)]
        match open(pid) {
            Ok(Some(fd)) => match AsyncFd::with_interest(fd, tokio::io::Interest::READABLE) {
                Ok(fd) => fds.push((pid, fd)),
                Err(_) => polled.push(pid),
            },
            Ok(None) => {} // gone already
            Err(_) => polled.push(pid),
        }
    }
    for (pid, fd) in fds {
        // Readable once the process has exited; an error of the poll is not an exit
        // (checked by its pid from here on).
        if fd.readable().await.is_err() {
            polled.push(pid);
        }
    }
    while polled.iter().any(|&pid| alive(pid)) {
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// A pidfd of `pid`; `None` when it has no process (`ESRCH`).
fn open(pid: u32) -> std::io::Result<Option<OwnedFd>> {
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return Ok(None);
    };
    match rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(rustix::io::Errno::SRCH) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// True while `/proc/<pid>` exists (a zombie has exited: its files, mappings and mount
/// namespace are released, so it holds nothing).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_once_every_watched_process_has_exited() {
        let mut a = std::process::Command::new("sleep")
            .arg("0.3")
            .spawn()
            .unwrap();
        let mut b = std::process::Command::new("sleep")
            .arg("0.6")
            .spawn()
            .unwrap();
        let pids = [a.id(), b.id(), u32::MAX];
        let t = std::time::Instant::now();
        // The children are not reaped until the watch is over: an exited zombie counts.
        tokio::time::timeout(Duration::from_secs(20), all_exited(&pids))
            .await
            .expect("the watch ends once both have exited");
        assert!(
            t.elapsed() >= Duration::from_millis(550),
            "{:?}",
            t.elapsed()
        );
        assert!(!alive(a.id()) && !alive(b.id()));
        a.wait().unwrap();
        b.wait().unwrap();
    }

    #[tokio::test]
    async fn a_process_that_runs_on_keeps_the_watch_waiting() {
        let mut a = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let w = tokio::time::timeout(Duration::from_millis(500), all_exited(&[a.id()])).await;
        assert!(w.is_err(), "the watch ended while the process runs");
        a.kill().unwrap();
        tokio::time::timeout(Duration::from_secs(20), all_exited(&[a.id()]))
            .await
            .expect("ended once killed");
        a.wait().unwrap();
    }
}
