//! `dhv-binder prestart`: what a job's prestart task runs; waits until this allocation's
//! deferred volumes are published on the node.

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
        super::volume::millis(waited.as_millis() as u64)
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
    let mut attempt = 0u32;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let uri = format!(
            "/v1/allocations/{}/publish?wait={}s",
            alloc_id,
            left.as_secs().max(1)
        );
        match call(&args.socket.path, hyper::Method::POST, &uri, Some(&token)).await {
            Ok(v) => {
                let reply: crate::api::PublishReply = serde_json::from_value(v)
                    .map_err(|e| Failure::new(EXIT_FAILED, format!("unexpected answer: {e}")))?;
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
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                eprintln!("dhv-binder: {e}; retrying");
                let d = crate::retry::backoff_delay(
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
                return Err(Failure::new(
                    code,
                    format!("dhv-binder: publish failed: {e}"),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
