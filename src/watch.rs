//! The watcher: one state machine that keeps the node's allocations known.
//!
//! list (`GET /v1/node/:id/allocations`, record the index) → stream
//! (`GET /v1/event/stream?topic=Allocation&namespace=*&index=<list index + 1>`) → on any
//! error, EOF, silence longer than the idle timeout, an index that goes backwards, or the
//! periodic resync: back off and list again. Events are hints: the stream can skip events
//! silently (resume at the closest index, buffer of 100, snapshot restore), so every
//! (re)connect starts with a full list (nomad-facts.md §1).

use crate::nomad::events::{decode_line, Line};
use crate::nomad::types::Allocation;
use crate::nomad::{Client, NomadError};
use futures_util::StreamExt;
use rand::Rng;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the watcher tells the agent.
#[derive(Debug, Clone)]
pub enum WatchEvent {
    /// A full list of the node's allocations at `index`: replaces the view.
    Relisted { allocs: Vec<Allocation>, index: u64 },
    /// One allocation changed (with its Job when it was fetched, without otherwise).
    Upsert(Box<Allocation>),
    /// An allocation is gone from Nomad (404: garbage-collected or purged).
    Removed(String),
    /// The watcher's health changed.
    Health(Health),
}

/// The watcher's connection health, for status output.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum Health {
    Listing,
    Streaming { index: u64 },
    Disconnected { reason: String, auth: bool },
}

/// Watcher settings.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    pub node_id: String,
    pub idle_timeout: Duration,
    pub resync_interval: Duration,
    /// Lines longer than this are skipped and counted.
    pub max_line: usize,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
}

impl WatchConfig {
    /// Defaults for a node: 95 s idle timeout (three missed 30 s heartbeats), 5 min resync.
    pub fn new(node_id: &str) -> Self {
        Self {
            node_id: node_id.to_string(),
            idle_timeout: Duration::from_secs(95),
            resync_interval: Duration::from_secs(300),
            max_line: 16 << 20,
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(30),
        }
    }
}

/// The watcher's states. `step` takes one by value and returns the next.
#[derive(Debug)]
enum State {
    List {
        attempt: u32,
    },
    Stream {
        index: u64,
        attempt: u32,
    },
    Backoff {
        attempt: u32,
        reason: String,
        auth: bool,
    },
    Stopped,
}

/// Exponential backoff with ±20 % jitter: `base * 2^attempt`, capped.
pub fn backoff_delay(base: Duration, cap: Duration, attempt: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.min(16));
    let d = exp.min(cap);
    let jitter = rand::thread_rng().gen_range(0.8..1.2);
    d.mul_f64(jitter)
}

/// Counters for status output.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Counters {
    pub relists: u64,
    pub frames: u64,
    pub skipped_other_nodes: u64,
    pub bad_lines: u64,
}

/// Runs the watcher until `tx` is closed.
pub async fn run(client: Client, cfg: WatchConfig, tx: mpsc::Sender<WatchEvent>) {
    let mut w = Watcher {
        client,
        cfg,
        tx,
        known: HashMap::new(),
        counters: Counters::default(),
    };
    let mut state = State::List { attempt: 0 };
    loop {
        state = w.step(state).await;
        if matches!(state, State::Stopped) {
            return;
        }
    }
}

struct Watcher {
    client: Client,
    cfg: WatchConfig,
    tx: mpsc::Sender<WatchEvent>,
    /// AllocModifyIndex of each allocation whose Job we have sent.
    known: HashMap<String, u64>,
    counters: Counters,
}

enum StreamEnd {
    Resync,
    Error(String, bool),
    Closed,
}

impl Watcher {
    async fn emit(&self, ev: WatchEvent) -> bool {
        self.tx.send(ev).await.is_ok()
    }

    async fn step(&mut self, state: State) -> State {
        match state {
            State::Stopped => State::Stopped,
            State::Backoff {
                attempt,
                reason,
                auth,
            } => {
                tracing::warn!(%reason, attempt, "allocation watch disconnected; relisting after backoff");
                if !self
                    .emit(WatchEvent::Health(Health::Disconnected {
                        reason: reason.clone(),
                        auth,
                    }))
                    .await
                {
                    return State::Stopped;
                }
                let base = if auth {
                    self.cfg.backoff_base.max(Duration::from_secs(1)) * 4
                } else {
                    self.cfg.backoff_base
                };
                tokio::time::sleep(backoff_delay(base, self.cfg.backoff_cap, attempt)).await;
                State::List {
                    attempt: attempt.saturating_add(1),
                }
            }
            State::List { attempt } => {
                if !self.emit(WatchEvent::Health(Health::Listing)).await {
                    return State::Stopped;
                }
                match self
                    .client
                    .node_allocations(&self.cfg.node_id, 0, Duration::ZERO)
                    .await
                {
                    Ok(list) => {
                        self.counters.relists += 1;
                        self.known = list
                            .value
                            .iter()
                            .map(|a| (a.id.clone(), a.alloc_modify_index))
                            .collect();
                        let index = list.index;
                        if !self
                            .emit(WatchEvent::Relisted {
                                allocs: list.value,
                                index,
                            })
                            .await
                        {
                            return State::Stopped;
                        }
                        State::Stream { index, attempt }
                    }
                    Err(e) => State::Backoff {
                        attempt,
                        auth: e.is_auth(),
                        reason: e.to_string(),
                    },
                }
            }
            State::Stream { index, attempt } => {
                let started = Instant::now();
                match self.stream(index).await {
                    StreamEnd::Resync => State::List { attempt: 0 },
                    StreamEnd::Closed => State::Stopped,
                    StreamEnd::Error(reason, auth) => {
                        // A stream that was healthy for a while resets the backoff.
                        let attempt = if started.elapsed() > Duration::from_secs(60) {
                            0
                        } else {
                            attempt
                        };
                        State::Backoff {
                            attempt,
                            reason,
                            auth,
                        }
                    }
                }
            }
        }
    }

    async fn stream(&mut self, list_index: u64) -> StreamEnd {
        let resp = match self.client.event_stream(list_index + 1).await {
            Ok(r) => r,
            Err(e) => return StreamEnd::Error(e.to_string(), e.is_auth()),
        };
        let mut body = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut last = list_index;
        let mut got_heartbeat = false;
        let resync_at = Instant::now() + self.cfg.resync_interval;
        let mut oversized = false;
        loop {
            let next = tokio::select! {
                n = tokio::time::timeout(self.cfg.idle_timeout, body.next()) => n,
                _ = tokio::time::sleep_until(resync_at) => return StreamEnd::Resync,
            };
            let chunk = match next {
                Err(_) => {
                    return StreamEnd::Error(
                        format!(
                            "event stream silent for {:?} (no heartbeat): treating it as dead",
                            self.cfg.idle_timeout
                        ),
                        false,
                    )
                }
                Ok(None) if !got_heartbeat => {
                    return StreamEnd::Error(
                        "event stream ended before its first heartbeat: the subscription was refused (does the token have read-job in every namespace?)".into(),
                        true,
                    )
                }
                Ok(None) => return StreamEnd::Error("event stream closed by the server".into(), false),
                Ok(Some(Err(e))) => return StreamEnd::Error(format!("event stream broke: {e}"), false),
                Ok(Some(Ok(c))) => c,
            };
            let mut rest: &[u8] = &chunk;
            while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
                let (head, tail) = rest.split_at(pos);
                rest = &tail[1..];
                if oversized {
                    // The end of a line we refused to buffer.
                    oversized = false;
                    buf.clear();
                    continue;
                }
                let line: Vec<u8> = if buf.is_empty() {
                    head.to_vec()
                } else {
                    let mut l = std::mem::take(&mut buf);
                    l.extend_from_slice(head);
                    l
                };
                match self.line(&line, &mut last, &mut got_heartbeat).await {
                    Ok(()) => {}
                    Err(end) => return end,
                }
            }
            if !oversized {
                buf.extend_from_slice(rest);
                if buf.len() > self.cfg.max_line {
                    self.counters.bad_lines += 1;
                    tracing::warn!(bytes = buf.len(), "skipping an oversized event stream line");
                    oversized = true;
                    buf.clear();
                }
            }
        }
    }

    async fn line(
        &mut self,
        line: &[u8],
        last: &mut u64,
        got_heartbeat: &mut bool,
    ) -> Result<(), StreamEnd> {
        match decode_line(line, &self.cfg.node_id, self.cfg.max_line) {
            Err(e) => {
                self.counters.bad_lines += 1;
                tracing::warn!(error = %e, "skipping an event stream line");
                Ok(())
            }
            Ok(Line::Heartbeat) => {
                if !*got_heartbeat {
                    *got_heartbeat = true;
                    if !self
                        .emit(WatchEvent::Health(Health::Streaming { index: *last }))
                        .await
                    {
                        return Err(StreamEnd::Closed);
                    }
                }
                Ok(())
            }
            Ok(Line::Frame {
                index,
                allocations,
                skipped,
            }) => {
                *got_heartbeat = true;
                self.counters.frames += 1;
                self.counters.skipped_other_nodes += skipped as u64;
                if index < *last {
                    return Err(StreamEnd::Error(
                        format!("event index went backwards ({index} < {last}): Nomad's state was reset or restored; relisting"),
                        false,
                    ));
                }
                if index == *last {
                    return Ok(()); // `index` is inclusive: this frame was seen already.
                }
                *last = index;
                for ev in allocations {
                    if let Err(e) = self.allocation(ev.allocation).await {
                        return Err(StreamEnd::Error(e.to_string(), e.is_auth()));
                    }
                }
                Ok(())
            }
        }
    }

    /// Sends an allocation update, fetching the full allocation (with its Job) when it is
    /// new to us or changed server-side.
    async fn allocation(&mut self, a: Allocation) -> Result<(), NomadError> {
        let needs_job = !a.is_client_terminal()
            && self
                .known
                .get(&a.id)
                .is_none_or(|&seen| a.alloc_modify_index > seen);
        let ev = if needs_job {
            match self.client.allocation(&a.id).await? {
                Some(full) => {
                    self.known.insert(full.id.clone(), full.alloc_modify_index);
                    WatchEvent::Upsert(Box::new(full))
                }
                None => {
                    self.known.remove(&a.id);
                    WatchEvent::Removed(a.id)
                }
            }
        } else {
            WatchEvent::Upsert(Box::new(a))
        };
        let _ = self.tx.send(ev).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let b = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        assert!(backoff_delay(b, cap, 0) <= Duration::from_millis(120));
        assert!(backoff_delay(b, cap, 3) >= Duration::from_millis(640));
        assert!(backoff_delay(b, cap, 30) <= Duration::from_millis(2400));
    }
}
