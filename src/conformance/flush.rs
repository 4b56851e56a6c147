//! The kit's rule `unpublish that cannot flush`: a plugin that caches writes (a FUSE remote
//! such as `rclone mount`) must not report an unpublish done while a write acknowledged
//! through the mount is still only in its cache and the storage cannot take it. The next
//! publish, on any node, reads the storage: a success there loses the file for good
//! (docs/plugin-protocol.md, "unpublish").
//!
//! The kit makes the storage unreachable the way the `fence` rule does, through the
//! volume's URL parameters: here it publishes with each `http(s)://` parameter pointed at a
//! relay on 127.0.0.1 that forwards to the real server, reads the mount's directory, cuts
//! the relay (live connections closed, new ones closed at once), writes a file through the
//! mount and unpublishes. The unpublish must fail (or be killed at its deadline: not a
//! success). Then the relay is restored; an unpublish must succeed (within three calls) and
//! a fresh publish must read the file back whole. A plugin without a URL parameter is
//! skipped (the kit cannot cut its storage off).

use super::{Kit, Operation};
use crate::storage::plugin::PluginError;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const RULE: &str = "unpublish that cannot flush";

/// How many bytes the kit writes through the mount while the storage is cut off.
const FILE_BYTES: usize = 64 * 1024;

/// A TCP relay on 127.0.0.1 to one storage server, which the kit can cut and restore.
struct Relay {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Listens on 127.0.0.1 and forwards each connection to `upstream` (`host:port`).
    async fn start(upstream: String) -> std::io::Result<Relay> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (c, k) = (cut.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    // Cut off: the connection is closed at once, as by a down server.
                    drop(inbound);
                    continue;
                }
                let up = upstream.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(up).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
                if let Ok(mut all) = k.lock() {
                    all.retain(|h| !h.is_finished());
                    all.push(task.abort_handle());
                }
            }
        });
        Ok(Relay {
            addr,
            cut,
            conns,
            accept,
        })
    }

    /// Cuts the storage off: every live connection closed, new ones closed at once.
    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        if let Ok(mut all) = self.conns.lock() {
            for h in all.drain(..) {
                h.abort();
            }
        }
    }

    /// Lets connections through again.
    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// `(scheme, host:port, rest)` of an `http://` or `https://` URL; `None` for anything else.
fn split_url(v: &str) -> Option<(&str, String, &str)> {
    let (scheme, rest) = v.split_once("://")?;
    if scheme != "http" && scheme != "https" {
        return None;
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    // user:password@ is not a host.
    let host = authority.rsplit('@').next().unwrap_or(authority);
    if host.is_empty() {
        return None;
    }
    let default_port = if scheme == "https" { 443 } else { 80 };
    let upstream = if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !host.ends_with(']')
    {
        host.to_string()
    } else {
        format!("{host}:{default_port}")
    };
    Some((scheme, upstream, path))
}

/// The bytes the kit writes (a pattern, so that a partial file shows).
fn pattern() -> Vec<u8> {
    (0..FILE_BYTES as u32)
        .map(|i| (i * 7 % 251) as u8)
        .collect()
}

/// Runs `f` on a blocking thread, bounded (a hung FUSE mount must not hang the kit).
async fn bounded<T: Send + 'static>(
    secs: u64,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_secs(secs), tokio::task::spawn_blocking(f)).await {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("it hung for {secs} s")),
    }
}

/// The rule (see the module's documentation).
pub(super) async fn unflushed_unpublish_rule(kit: &mut Kit) {
    let mut rec = kit.rec.clone();
    let mut relays = Vec::new();
    for v in rec.spec.parameters.values_mut() {
        let Some((scheme, upstream, path)) = split_url(v) else {
            continue;
        };
        match Relay::start(upstream).await {
            Ok(r) => {
                *v = format!("{scheme}://{}{path}", r.addr);
                relays.push(r);
            }
            Err(e) => {
                kit.report.push(
                    RULE,
                    false,
                    format!("the kit cannot listen on 127.0.0.1 for its relay to the storage: {e}"),
                );
                return;
            }
        }
    }
    if relays.is_empty() {
        kit.report.not_run(
            RULE,
            "no http(s):// parameter: the kit cannot make this plugin's storage unreachable (a local plugin, with no cache to lose, skips it)",
        );
        return;
    }
    let target = kit.target("unflushed");
    let ctx = match kit.publish_rec(&rec, &target, false).await {
        Ok(c) => c,
        Err(e) => {
            kit.report.push(
                RULE,
                false,
                format!("publish through the kit's relay to the storage failed: {e}"),
            );
            return;
        }
    };
    // A fresh listing (a cache that must ask the storage about the directory has its answer),
    // then the storage goes away and a file is written through the mount.
    let t = target.clone();
    let _ = bounded(10, move || std::fs::read_dir(&t).map(|d| d.count())).await;
    for r in &relays {
        r.cut();
    }
    let name = format!("unflushed-{}", uuid::Uuid::new_v4());
    let file = target.join(&name);
    let f = file.clone();
    let written = bounded(10, move || std::fs::write(&f, pattern())).await;
    let env = kit.unpublish_env_of(&rec, &target, &ctx);
    let cut_off = kit.call(Operation::Unpublish, &env).await;
    for r in &relays {
        r.restore();
    }
    let verdict = match (&written, &cut_off.result) {
        (Err(e), _) => Ok(format!(
            "with the storage unreachable a write through the mount failed ({e}): nothing was acknowledged, nothing to flush"
        )),
        (Ok(()), Ok(_)) => Err(format!(
            "unpublish reported success in {} ms with the storage unreachable and {FILE_BYTES} bytes written through the mount not on it (they are lost when the volume is published anywhere else): it must fail until the storage has them",
            cut_off.ms
        )),
        (Ok(()), Err(PluginError::TimedOut { .. })) => Ok(format!(
            "with the storage unreachable, unpublish did not finish and was killed at its deadline ({} ms): not a success (better: fail within the deadline, naming the unsaved files)",
            cut_off.ms
        )),
        (Ok(()), Err(e)) => Ok(format!(
            "with the storage unreachable and {FILE_BYTES} bytes written through the mount, unpublish failed in {} ms: {}",
            cut_off.ms,
            super::short(&e.report())
        )),
    };
    // The storage is back: the unpublish completes, and the file is there for the next
    // publish.
    let mut released = Err(String::from("not tried"));
    if crate::node::mounts::is_mount_point(&target) || cut_off.result.is_err() {
        for _ in 0..3 {
            released = kit.unpublish_rec(&rec, &target, &ctx).await;
            if released.is_ok() {
                break;
            }
        }
    } else {
        released = Ok(());
    }
    let mut kept = Ok(());
    if written.is_ok() {
        let again = kit.target("unflushed-again");
        kept = match kit.publish_rec(&rec, &again, true).await {
            Ok(c2) => {
                let f = again.join(&name);
                let got = bounded(10, move || std::fs::read(&f)).await;
                let _ = kit.unpublish_rec(&rec, &again, &c2).await;
                match got {
                    Ok(b) if b == pattern() => Ok(()),
                    Ok(b) => Err(format!(
                        "the next publish read {} of the {FILE_BYTES} bytes written (or other bytes)",
                        b.len()
                    )),
                    Err(e) => Err(format!(
                        "the next publish does not have the file written while the storage was unreachable ({e}): it was lost"
                    )),
                }
            }
            Err(e) => Err(format!("publish after the storage came back failed: {e}")),
        };
    }
    let ok = verdict.is_ok() && released.is_ok() && kept.is_ok();
    let mut evidence = match verdict {
        Ok(s) | Err(s) => s,
    };
    if let Err(e) = released {
        evidence.push_str(&format!(
            "; with the storage back, unpublish still failed 3 times: {e}"
        ));
    }
    match kept {
        Ok(()) if written.is_ok() => evidence.push_str(
            "; with the storage back, unpublish succeeded and the next publish read the file whole",
        ),
        Ok(()) => {}
        Err(e) => evidence.push_str(&format!("; {e}")),
    }
    kit.report.push(RULE, ok, evidence);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_split_into_scheme_upstream_and_path() {
        assert_eq!(
            split_url("http://127.0.0.1:8080/dav/"),
            Some(("http", "127.0.0.1:8080".to_string(), "/dav/"))
        );
        assert_eq!(
            split_url("https://u:p@storage.example"),
            Some(("https", "storage.example:443".to_string(), ""))
        );
        assert_eq!(split_url("/srv/export"), None);
        assert_eq!(split_url("ftp://x/"), None);
    }

    /// The relay forwards, closes everything when cut, and forwards again when restored.
    #[tokio::test]
    async fn the_relay_forwards_cuts_and_restores() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = server.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = server.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 4];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let relay = Relay::start(up).await.unwrap();
        let echo = |addr: SocketAddr| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            s.write_all(b"ping").await.ok()?;
            let mut b = [0u8; 4];
            tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut b))
                .await
                .ok()?
                .ok()?;
            Some(b)
        };
        assert_eq!(echo(relay.addr).await, Some(*b"ping"));
        relay.cut();
        assert_eq!(echo(relay.addr).await, None);
        relay.restore();
        assert_eq!(echo(relay.addr).await, Some(*b"ping"));
    }
}
