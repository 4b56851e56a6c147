//! Stream mode: after the list, the event stream of the Allocation and Job topics, read line
//! by line; this node's allocation events become reads (or deletions), other nodes' are
//! dropped after reading their `NodeID`; a deregistered job's allocations here are read
//! again, and so is one whose processes are gone (the process probe).

use super::*;
use futures_util::StreamExt;

impl Watcher {
    pub(super) async fn stream(&mut self, list_index: u64) -> StreamEnd {
        let resp = match self.client.event_stream(list_index + 1).await {
            Ok(r) => r,
            Err(e) => return StreamEnd::Fault(Fault::of(&e), e.to_string()),
        };
        let mut body = resp.bytes_stream();
        let mut lines = LineBuffer::new(self.cfg.max_line);
        let mut last_frame: Option<u64> = None;
        let mut got_heartbeat = false;
        let mut resync_at = self.last_list + self.cfg.resync_interval;
        let mut health_at = Instant::now();
        let mut bad_seen = false;
        let mut fetches = Fetches::new(
            self.client.clone(),
            &self.cfg.node_id,
            self.cfg.idle_timeout,
        );
        let mut verify_at = Instant::now() + self.cfg.verify_interval;
        loop {
            let verify = !self.verifying.is_empty();
            let next = tokio::select! {
                n = tokio::time::timeout(self.cfg.idle_timeout, body.next()) => n,
                _ = tokio::time::sleep_until(resync_at) => return StreamEnd::Resync,
                Some(answer) = fetches.running.next(), if !fetches.running.is_empty() => {
                    let reads = match fetches.answered(answer) {
                        Ok(reads) => reads,
                        Err(e) => return StreamEnd::Fault(Fault::of(&e), e.to_string()),
                    };
                    for (id, read) in reads {
                        if let Err(end) = self.fetched(&mut fetches, id, read).await {
                            return end;
                        }
                    }
                    fetches.flush(self.known.len());
                    continue;
                }
                _ = tokio::time::sleep_until(verify_at), if verify => {
                    verify_at = Instant::now() + self.cfg.verify_interval;
                    self.verify(&mut fetches);
                    fetches.flush(self.known.len());
                    continue;
                }
                _ = tokio::time::sleep_until(self.probe_at), if self.cfg.processes.is_some() => {
                    // A purge on Nomad before 1.11.3 says nothing this node can tell from a
                    // stop: an allocation whose processes are gone is read (404: Removed).
                    self.probe_at = Instant::now() + self.cfg.verify_interval;
                    for id in self.probe_gone().await {
                        self.verify_gone(&id, &mut fetches);
                    }
                    fetches.flush(self.known.len());
                    continue;
                }
            };
            let chunk = match next {
                Err(_) => {
                    return StreamEnd::Fault(
                        Fault::Stalled,
                        format!(
                            "event stream disconnected: silent for {:?} (no heartbeat); treating it as dead",
                            self.cfg.idle_timeout
                        ),
                    )
                }
                Ok(None) if !got_heartbeat => {
                    return StreamEnd::Fault(
                        Fault::AuthFailed,
                        "event stream ended before its first heartbeat: the subscription was refused (the token is expired, or lacks read-job in every namespace)".into(),
                    )
                }
                Ok(None) => {
                    return StreamEnd::Fault(
                        Fault::ClosedByServer,
                        "event stream disconnected: closed by the server".into(),
                    )
                }
                Ok(Some(Err(e))) => {
                    return StreamEnd::Fault(
                        Fault::Unreachable,
                        format!("event stream disconnected: {e}"),
                    )
                }
                Ok(Some(Ok(c))) => c,
            };
            lines.push(&chunk);
            while let Some(piece) = lines.next_piece() {
                let bad = match piece {
                    Piece::Oversized(n) => {
                        tracing::warn!(
                            bytes = n,
                            limit = self.cfg.max_line,
                            "skipped an oversized event stream line"
                        );
                        true
                    }
                    Piece::Line(line) => {
                        match self
                            .line(
                                &line,
                                list_index,
                                &mut last_frame,
                                &mut got_heartbeat,
                                &mut fetches,
                            )
                            .await
                        {
                            Ok(bad) => bad,
                            Err(end) => return end,
                        }
                    }
                };
                if bad {
                    // The line may have carried one of our events: relist soon, spacing
                    // such relists out exponentially (no relist loop on a bad feed).
                    self.counters.bad_lines += 1;
                    if !bad_seen {
                        bad_seen = true;
                        let gap = backoff_delay(
                            self.cfg.backoff_base,
                            self.cfg.backoff_cap,
                            self.bad_streak,
                        );
                        self.bad_streak = self.bad_streak.saturating_add(1);
                        resync_at = resync_at.min((self.last_list + gap).max(Instant::now()));
                    }
                    health_at = Instant::now() - Duration::from_secs(10);
                }
            }
            // The chunk's reads start together: a burst's many reads become one list.
            fetches.flush(self.known.len());
            if got_heartbeat && health_at.elapsed() >= Duration::from_secs(5) {
                health_at = Instant::now();
                let h = Health::Streaming {
                    index: last_frame.unwrap_or(list_index),
                    counters: self.counters.clone(),
                };
                if !self.emit(WatchEvent::Health(h)).await {
                    return StreamEnd::Closed;
                }
            }
        }
    }

    /// Handles one line. `Ok(true)`: the line was unusable and skipped.
    pub(super) async fn line(
        &mut self,
        line: &[u8],
        list_index: u64,
        last_frame: &mut Option<u64>,
        got_heartbeat: &mut bool,
        fetches: &mut Fetches,
    ) -> Result<bool, StreamEnd> {
        let first = !*got_heartbeat;
        let result = match decode_line(line, &self.cfg.node_id, self.cfg.max_line) {
            Err(e) => {
                tracing::warn!(error = %e, bytes = line.len(), "skipped an event stream line");
                return Ok(true);
            }
            Ok(Line::Heartbeat) => {
                *got_heartbeat = true;
                Ok(false)
            }
            Ok(Line::Frame {
                index,
                allocations,
                skipped,
                deregistered_jobs,
            }) => {
                *got_heartbeat = true;
                self.counters.frames += 1;
                self.counters.skipped_other_nodes += skipped as u64;
                if last_frame.is_some_and(|l| index < l) {
                    self.counters.index_resets += 1;
                    return Err(StreamEnd::Fault(
                        Fault::IndexReset,
                        format!(
                            "event index went backwards ({index} after {}): Nomad's state was reset or restored; relisting",
                            last_frame.unwrap_or_default()
                        ),
                    ));
                }
                if index <= list_index || last_frame.is_some_and(|l| index == l) {
                    // Covered by the list (Nomad resends the closest index it has, and
                    // `index` is inclusive), or a repeated frame.
                    self.counters.stale_frames += 1;
                    return Ok(false);
                }
                *last_frame = Some(index);
                self.last_index = self.last_index.max(index);
                for ev in allocations {
                    if !self.allocation(ev.allocation, fetches).await {
                        return Err(StreamEnd::Closed);
                    }
                }
                if !deregistered_jobs.is_empty() {
                    self.job_deregistered(&deregistered_jobs, fetches);
                }
                Ok(false)
            }
        };
        if first && *got_heartbeat {
            let h = Health::Streaming {
                index: last_frame.unwrap_or(list_index),
                counters: self.counters.clone(),
            };
            if !self.emit(WatchEvent::Health(h)).await {
                return Err(StreamEnd::Closed);
            }
        }
        result
    }
}
