//! `dhv-binder prestart`: what a job's prestart task runs; waits until this allocation's
//! deferred volumes are published on the node. While it waits it says why, in its task's
//! log (stderr): once the wait starts (within a second: the agent answers a call that asked
//! for `progress` as soon as the allocation waits for something outside it), then a short
//! line every `--progress-every` (what changed, how long), and the final reason once. Each
//! line is one line under [`MAX_LINE`] characters. An agent older than this answers only at
//! the end (the final reason is then all the log says).

use super::{Failure, EXIT_CONFIG, EXIT_FAILED, EXIT_TIMEOUT, EXIT_UNAVAILABLE};
use crate::api::client::{call, CallError};
use crate::volume;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Arguments of `prestart`.
#[derive(Debug, clap::Args)]
pub struct PrestartArgs {
    #[command(flatten)]
    pub socket: super::SocketArg,
    /// The allocation to publish for (Nomad sets NOMAD_ALLOC_ID in every task).
    #[arg(long, env = "NOMAD_ALLOC_ID")]
    pub alloc_id: Option<String>,
    /// How long to wait in total, retrying retryable errors.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// How often a waiting prestart says it still waits (and since how long).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub progress_every: Duration,
}

/// The longest line `prestart` prints (the bound: one line, under 200 characters).
pub const MAX_LINE: usize = 199;

/// `line` cut to [`MAX_LINE`] characters (an ellipsis marks a cut), on one line.
fn one_line(line: &str) -> String {
    bounded_line(line, MAX_LINE)
}

/// The final failure, printed as `Error: <message>` (src/main.rs): `message` bounded so
/// that the whole line stays within [`MAX_LINE`].
fn final_line(message: &str) -> String {
    bounded_line(message, MAX_LINE - "Error: ".len())
}

fn bounded_line(line: &str, max: usize) -> String {
    let flat: String = line
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max - 1).collect();
    cut.push('…');
    cut
}

/// A wait in whole seconds, as `1m 30s`.
fn secs(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

/// What the prestart printed last about its wait.
#[derive(Debug, Default)]
struct Told {
    /// The reason last printed and its digest.
    reason: String,
    id: String,
    /// When a line was last printed.
    at: Option<Instant>,
}

impl Told {
    /// The line for a progress report `w` received `waited` after the start: the first
    /// reason, a changed one, or (at a progress tick) the same one again, with how long.
    fn line(&mut self, w: &crate::api::WaitReport, waited: Duration, now: Instant) -> String {
        let t = secs(waited);
        let line = if self.id.is_empty() {
            format!("dhv-binder: waiting: {}", w.reason)
        } else if w.id != self.id {
            format!("dhv-binder: still waiting after {t}, now: {}", w.reason)
        } else {
            format!(
                "dhv-binder: still waiting after {t}, unchanged: {}",
                w.reason
            )
        };
        self.reason = w.reason.clone();
        self.id = w.id.clone();
        self.at = Some(now);
        one_line(&line)
    }
}

/// What `prestart` prints for a published volume: where, and how long this prestart waited
/// for it (measured from its start to the agent's answer, retries included).
pub fn published_line(v: &crate::api::PublishedVolume, waited: Duration) -> String {
    format!(
        "dhv-binder: volume {}/{} published at {}{} after {}",
        v.namespace,
        v.name,
        v.path,
        if v.read_only { " (read-only)" } else { "" },
        super::output::millis(waited.as_millis() as u64)
    )
}

/// Runs `prestart`: calls the local API, retrying retryable errors until the timeout.
pub async fn prestart(args: PrestartArgs, token: Option<String>) -> Result<(), Failure> {
    let token = match token.filter(|t| !t.is_empty()) {
        Some(t) => t,
        None => {
            let dir = std::env::var("NOMAD_SECRETS_DIR").unwrap_or_else(|_| "/secrets".into());
            std::fs::read_to_string(PathBuf::from(&dir).join("nomad_token"))
                .map(|s| s.trim().to_string())
                .map_err(|_| {
                    Failure::new(
                        EXIT_CONFIG,
                        "no workload identity token: add `identity { env = true }` (or file = true) to the prestart task",
                    )
                })?
        }
    };
    let Some(alloc_id) = args.alloc_id.clone() else {
        return Err(Failure::new(
            EXIT_CONFIG,
            "NOMAD_ALLOC_ID is not set: `dhv-binder prestart` runs inside a Nomad task (the job's prestart task), where Nomad sets it",
        ));
    };
    if !volume::is_alloc_id(&alloc_id) {
        return Err(Failure::new(
            EXIT_CONFIG,
            format!("NOMAD_ALLOC_ID {alloc_id:?} is not an allocation ID"),
        ));
    }
    let started = Instant::now();
    let deadline = started + args.timeout;
    let every = args.progress_every.max(Duration::from_secs(1));
    let mut told = Told::default();
    let mut attempt = 0u32;
    loop {
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        let next_line = told.at.unwrap_or(started) + every;
        let uri = format!(
            "/v1/allocations/{}/publish?wait={}ms&progress={}ms&seen={}",
            alloc_id,
            left.as_millis().max(1000),
            next_line
                .saturating_duration_since(now)
                .as_millis()
                .max(1000),
            told.id
        );
        match call(&args.socket.path, hyper::Method::POST, &uri, Some(&token)).await {
            Ok(v) => {
                let reply: crate::api::PublishReply = serde_json::from_value(v)
                    .map_err(|e| Failure::new(EXIT_FAILED, format!("unexpected answer: {e}")))?;
                if let Some(w) = &reply.waiting {
                    eprintln!("{}", told.line(w, started.elapsed(), Instant::now()));
                    if Instant::now() >= deadline {
                        return Err(Failure::new(
                            EXIT_TIMEOUT,
                            final_line(&format!(
                                "publish failed after {}: {}",
                                secs(started.elapsed()),
                                w.reason
                            )),
                        ));
                    }
                    continue;
                }
                if reply.volumes.is_empty() {
                    outln!(
                        "dhv-binder: allocation {} uses no deferred volumes",
                        reply.alloc_id
                    );
                }
                let waited = started.elapsed();
                for v in reply.volumes {
                    outln!("{}", published_line(&v, waited));
                }
                return Ok(());
            }
            // Retried while more than a second is left (the agent's own deadline is this
            // call's wait: its answer at the end is the final reason, printed once below).
            Err(e)
                if e.is_retryable()
                    && deadline.saturating_duration_since(Instant::now())
                        > Duration::from_secs(1) =>
            {
                eprintln!("{}", one_line(&format!("dhv-binder: {e}; retrying")));
                let d = crate::nomad::retry::backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(10),
                    attempt,
                );
                tokio::time::sleep(d.min(deadline.saturating_duration_since(Instant::now()))).await;
                attempt += 1;
            }
            Err(e) => {
                let code = match &e {
                    CallError::Connect { .. } => EXIT_UNAVAILABLE,
                    _ if e.is_retryable() => EXIT_TIMEOUT,
                    _ => EXIT_FAILED,
                };
                let message = match &e {
                    CallError::Api { message, .. } => message.clone(),
                    other => other.to_string(),
                };
                return Err(Failure::new(
                    code,
                    final_line(&format!(
                        "publish failed after {}: {message}",
                        secs(started.elapsed())
                    )),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 46 #2: the first reason, a tick with the same reason, a changed one: one line
    /// each, under 200 characters, saying how long; the final line within the bound too.
    #[test]
    fn progress_lines_say_why_what_changed_and_how_long_in_one_short_line() {
        let now = Instant::now();
        let mut told = Told::default();
        let held = crate::api::WaitReport::of(
            "the single-node claim on default/data is held by job web, allocation 1234abcd on node node-1".into(),
        );
        assert_eq!(
            told.line(&held, Duration::from_millis(300), now),
            "dhv-binder: waiting: the single-node claim on default/data is held by job web, allocation 1234abcd on node node-1"
        );
        let l = told.line(&held, Duration::from_millis(30_400), now);
        assert!(
            l.starts_with("dhv-binder: still waiting after 30s, unchanged: the single-node claim"),
            "{l}"
        );
        let other = crate::api::WaitReport::of(
            "the single-node claim on default/data is held by node node-1 (its allocation stopped)"
                .into(),
        );
        let l = told.line(&other, Duration::from_secs(75), now);
        assert!(
            l.starts_with("dhv-binder: still waiting after 1m 15s, now: "),
            "{l}"
        );
        let long = crate::api::WaitReport::of(format!("{}\nsecond line", "x".repeat(400)));
        let l = told.line(&long, Duration::from_secs(90), now);
        assert_eq!(l.chars().count(), MAX_LINE);
        assert!(!l.contains('\n'), "{l}");
        let f = final_line(&"y".repeat(500));
        assert_eq!(format!("Error: {f}").chars().count(), MAX_LINE);
    }

    /// Issue 37 #15: the wait printed is the one measured, not a configured constant.
    #[test]
    fn the_published_line_says_how_long_this_prestart_waited() {
        let v: crate::api::PublishedVolume = serde_json::from_value(serde_json::json!({
            "namespace": "default", "name": "shared-data", "path": "/srv/x", "read_only": true
        }))
        .unwrap();
        assert_eq!(
            published_line(&v, Duration::from_millis(1234)),
            "dhv-binder: volume default/shared-data published at /srv/x (read-only) after 1.2s"
        );
        assert!(published_line(&v, Duration::from_millis(87)).ends_with(" after 87ms"));
    }
}
