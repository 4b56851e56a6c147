//! Event stream frames, decoded lazily.
//!
//! Nomad API: `GET /v1/event/stream` sends NDJSON: `{}` heartbeats and frames
//! `{"Index":N,"Events":[{"Topic","Type","Key","Namespace","FilterKeys","Index","Payload"}]}`.
//! The stream has no per-node filter (nomad-facts.md §1), so every daemon sees every
//! allocation event of the cluster. [`decode_line`] reads only the envelope and the
//! allocation's `NodeID`; the rest of a payload is decoded only for this node's allocations.
//!
//! Cost per other-node event: one validating scan of its bytes (serde_json skipping the
//! payload as a raw value, no allocation) and a walk over the first keys of the payload up
//! to `NodeID` (the fifth key in Nomad's field order: `ID, Namespace, EvalID, Name, NodeID`).
//! [`LineBuffer`] splits the body into lines without copying them again and drops lines
//! longer than the limit without ever holding more than the limit in memory.

use super::scan;
use super::types::Allocation;
use serde::Deserialize;

/// What one NDJSON line of the event stream holds.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// `{}`: the subscription is alive.
    Heartbeat,
    /// A frame, with the allocations of this node it carries (fully decoded, without `Job`).
    Frame {
        /// The raft index of the frame.
        index: u64,
        /// Allocation events of this node, in stream order.
        allocations: Vec<AllocationEvent>,
        /// Allocation events of other nodes, skipped without decoding their payloads.
        skipped: usize,
        /// Jobs that may have been deleted from Nomad's state: the Job topic's
        /// `JobDeregistered` (a stop or a purge) and `JobBatchDeregistered` (the GC of a dead
        /// job). A deleted job's allocations were deleted in the same write, with no
        /// allocation event (`nomad/state/state_store.go` `DeleteJobTxn` →
        /// `deleteAllocsForJobTxn`). Nomad 1.11.3 and 2.0 mark a deletion with `Deleted`
        /// (hashicorp/nomad#27614); before, a deletion's payload is `{"Job": …}` as a stop's
        /// is (`nomad/state/events.go` `eventFromChange`), so every one is listed and the
        /// watch reads the allocations it holds of them.
        deregistered_jobs: Vec<JobRef>,
    },
}

/// A job, by namespace and ID.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobRef {
    /// `Namespace`.
    pub namespace: crate::nomad::types::Text,
    /// `ID`.
    pub id: crate::nomad::types::Text,
}

/// One allocation event for this node.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocationEvent {
    /// Event Type, e.g. `PlanResult`, `AllocationUpdated`, `AllocationUpdateDesiredStatus`.
    pub event_type: String,
    /// The allocation, as the payload carries it (no `Job`).
    pub allocation: Allocation,
}

/// Why a line could not be used. The stream goes on; the line is counted and skipped.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The line is not the JSON Nomad sends.
    #[error("event stream line is not a Nomad frame: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The frame's structure is not JSON (found by the lazy scanner at this byte offset).
    #[error("event stream line is not a Nomad frame: bad JSON near byte {0}")]
    Syntax(usize),
    /// The line exceeds the configured limit.
    #[error("event stream line of {0} bytes exceeds the limit")]
    TooLong(usize),
}

#[derive(Deserialize)]
struct FullPayload {
    #[serde(rename = "Allocation")]
    allocation: Allocation,
}

/// A Job event's payload `{"Job":{…},"Deleted":true}` (`nomad/structs/event.go`
/// `JobEvent`; `Deleted` from Nomad 1.11.3, absent before), read as far as the job's
/// namespace and ID.
#[derive(Deserialize)]
struct JobPayload {
    #[serde(rename = "Job")]
    job: JobIds,
}

#[derive(Deserialize)]
struct JobIds {
    #[serde(rename = "ID")]
    id: String,
    #[serde(rename = "Namespace", default)]
    namespace: String,
}

/// Decodes one line of the stream, keeping only allocation events whose `NodeID` is `node_id`
/// and the jobs a Job event says were deleted (its other events are skipped undecoded).
///
/// Blank lines are heartbeats too (a keep-alive of some proxies). Lines longer than
/// `max_len` bytes are refused without being parsed.
pub fn decode_line(line: &[u8], node_id: &str, max_len: usize) -> Result<Line, LineError> {
    if line.len() > max_len {
        return Err(LineError::TooLong(line.len()));
    }
    let trimmed = line.trim_ascii();
    if trimmed.is_empty() {
        return Ok(Line::Heartbeat);
    }
    let mut allocations = Vec::new();
    let mut deregistered_jobs = Vec::new();
    let mut skipped = 0;
    let mut err = None;
    let index = scan::frame(trimmed, |topic, event_type, payload| {
        if err.is_some() {
            return;
        }
        if topic == b"Job" {
            if matches!(event_type, b"JobDeregistered" | b"JobBatchDeregistered") {
                match serde_json::from_slice::<JobPayload>(payload) {
                    Ok(p) => deregistered_jobs.push(JobRef {
                        namespace: p.job.namespace.into(),
                        id: p.job.id.into(),
                    }),
                    Err(e) => err = Some(e),
                }
            }
            return;
        }
        if topic != b"Allocation" {
            return;
        }
        if !scan::node_id_is(payload, node_id) {
            skipped += 1;
            return;
        }
        match serde_json::from_slice::<FullPayload>(payload) {
            Ok(full) => allocations.push(AllocationEvent {
                event_type: String::from_utf8_lossy(event_type).into_owned(),
                allocation: full.allocation,
            }),
            Err(e) => err = Some(e),
        }
    })
    .map_err(LineError::Syntax)?;
    if let Some(e) = err {
        return Err(LineError::Malformed(e));
    }
    let Some(index) = index else {
        return Ok(Line::Heartbeat);
    };
    Ok(Line::Frame {
        index,
        allocations,
        skipped,
        deregistered_jobs,
    })
}

/// One piece of the stream body cut by [`LineBuffer`].
#[derive(Debug, PartialEq)]
pub enum Piece {
    /// A complete line, without its `\n`.
    Line(bytes::Bytes),
    /// A line longer than the limit was dropped; its length in bytes.
    Oversized(usize),
}

/// Splits a streamed body into NDJSON lines. Holds at most `max` bytes of an unfinished
/// line: a longer line is dropped as it arrives and reported once its end is seen.
#[derive(Debug)]
pub struct LineBuffer {
    buf: bytes::BytesMut,
    max: usize,
    scanned: usize,
    dropped: Option<usize>,
}

impl LineBuffer {
    /// A buffer for lines of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            buf: bytes::BytesMut::new(),
            max,
            scanned: 0,
            dropped: None,
        }
    }

    /// Appends a chunk of the body.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes held for an unfinished line.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Bytes allocated for the buffer: back near the held bytes after a large line.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// After a large line, gives its memory back: a buffer holding far less than it has
    /// allocated is copied into a fresh one.
    fn shrink(&mut self) {
        const KEEP: usize = 64 << 10;
        if self.buf.capacity() > KEEP && self.buf.len() <= KEEP / 2 {
            self.buf = bytes::BytesMut::from(&self.buf[..]);
        }
    }

    /// The next complete line or dropped line, if any.
    pub fn next_piece(&mut self) -> Option<Piece> {
        match memchr::memchr(b'\n', &self.buf[self.scanned..]) {
            Some(p) => {
                let mut line = self.buf.split_to(self.scanned + p + 1);
                self.scanned = 0;
                self.shrink();
                if let Some(d) = self.dropped.take() {
                    return Some(Piece::Oversized(d + line.len() - 1));
                }
                line.truncate(line.len() - 1);
                if line.len() > self.max {
                    return Some(Piece::Oversized(line.len()));
                }
                Some(Piece::Line(line.freeze()))
            }
            None => {
                self.scanned = self.buf.len();
                if self.buf.len() > self.max {
                    *self.dropped.get_or_insert(0) += self.buf.len();
                    self.buf.clear();
                    self.scanned = 0;
                    self.shrink();
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_and_blank_lines() {
        assert_eq!(decode_line(b"{}", "n", 1024).unwrap(), Line::Heartbeat);
        assert_eq!(decode_line(b"  \r", "n", 1024).unwrap(), Line::Heartbeat);
    }

    #[test]
    fn other_nodes_are_skipped_and_own_decoded() {
        let line = br#"{"Index":7,"Events":[
            {"Topic":"Allocation","Type":"PlanResult","Key":"a1","Index":7,"Payload":{"Allocation":{"ID":"a1","NodeID":"other","ClientStatus":"pending"}}},
            {"Topic":"Allocation","Type":"AllocationUpdated","Key":"a2","Index":7,"Payload":{"Allocation":{"ID":"a2","NodeID":"me","ClientStatus":"running","TaskStates":null}}},
            {"Topic":"Job","Type":"AllocationUpdated","Key":"j","Index":7,"Payload":{"Job":{"ID":"j"}}}]}"#;
        let Line::Frame {
            index,
            allocations,
            skipped,
            deregistered_jobs,
        } = decode_line(line, "me", 1 << 20).unwrap()
        else {
            panic!("expected a frame")
        };
        assert_eq!(index, 7);
        assert_eq!(skipped, 1);
        assert_eq!(allocations.len(), 1);
        assert_eq!(&*allocations[0].allocation.id, "a2");
        assert_eq!(allocations[0].event_type, "AllocationUpdated");
        assert!(deregistered_jobs.is_empty());
    }

    /// A deregistration's Job event names the job, with `Deleted` (a purge from Nomad
    /// 1.11.3) or without it (a stop, or a purge before 1.11.3: the two look alike); other
    /// Job events do not; a Job payload that is not a job is an
    /// error as any other.
    #[test]
    fn deregistered_jobs_are_read_from_the_job_topic() {
        let line = br#"{"Index":9,"Events":[
            {"Topic":"Job","Type":"JobDeregistered","Key":"web","Namespace":"apps","Index":9,"Payload":{"Job":{"Stop":true,"Namespace":"apps","ID":"web","TaskGroups":[{"Name":"g"}]},"Deleted":true}},
            {"Topic":"Job","Type":"JobDeregistered","Key":"db","Namespace":"default","Index":9,"Payload":{"Job":{"Namespace":"default","ID":"db"}}},
            {"Topic":"Job","Type":"JobRegistered","Key":"x","Namespace":"default","Index":9,"Payload":{"Job":{"ID":"x"},"Deleted":true}},
            {"Topic":"Job","Type":"JobBatchDeregistered","Key":"old","Namespace":"default","Index":9,"Payload":{"Job":{"Namespace":"default","ID":"old"},"Deleted":true}}]}"#;
        let Line::Frame {
            deregistered_jobs, ..
        } = decode_line(line, "me", 1 << 20).unwrap()
        else {
            panic!("expected a frame")
        };
        let job = |namespace: &str, id: &str| JobRef {
            namespace: namespace.into(),
            id: id.into(),
        };
        assert_eq!(
            deregistered_jobs,
            [
                job("apps", "web"),
                job("default", "db"),
                job("default", "old")
            ]
        );
        let bad = br#"{"Index":9,"Events":[{"Topic":"Job","Type":"JobDeregistered","Payload":{"Job":7,"Deleted":true}}]}"#;
        assert!(matches!(
            decode_line(bad, "me", 1 << 20),
            Err(LineError::Malformed(_))
        ));
    }

    #[test]
    fn garbage_and_oversized_lines_are_errors() {
        assert!(matches!(
            decode_line(b"not json", "n", 1024),
            Err(LineError::Syntax(_))
        ));
        assert!(matches!(
            decode_line(&[b' '; 2048], "n", 1024),
            Err(LineError::TooLong(2048))
        ));
    }

    #[test]
    fn line_buffer_splits_across_chunks_and_drops_long_lines() {
        let mut lb = LineBuffer::new(8);
        lb.push(b"{}\n{\"In");
        assert_eq!(
            lb.next_piece(),
            Some(Piece::Line(bytes::Bytes::from_static(b"{}")))
        );
        assert_eq!(lb.next_piece(), None);
        lb.push(b"dex\":1}");
        assert_eq!(lb.next_piece(), None);
        lb.push(b"\nabc");
        assert_eq!(lb.next_piece(), Some(Piece::Oversized(11)));
        lb.push(b"defghijklmnop");
        assert_eq!(lb.next_piece(), None);
        assert!(lb.pending() <= 8 + 13);
        lb.push(b"q\n{}\n");
        assert_eq!(lb.next_piece(), Some(Piece::Oversized(17)));
        assert_eq!(
            lb.next_piece(),
            Some(Piece::Line(bytes::Bytes::from_static(b"{}")))
        );
        assert_eq!(lb.next_piece(), None);
    }

    #[test]
    fn lazy_scan_agrees_with_serde_on_fixtures_and_captures() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
        let mut lines: Vec<String> = Vec::new();
        for f in [
            "nomad-fixtures/event-stream-allocation.ndjson",
            "nomad-captures/event-stream-frame-allocupdated-complete-connect-sidecar-1.2.ndjson",
        ] {
            let text = std::fs::read_to_string(dir.join(f)).unwrap();
            lines.extend(text.lines().map(String::from));
        }
        for f in [
            "nomad-captures/event-stream-frame-allocupdated-alloc-job-node-1.6.3.json",
            "nomad-captures/event-stream-frame-evaluation-jobregistered-1.6.3.json",
        ] {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap();
            lines.push(serde_json::to_string_pretty(&v).unwrap().replace('\n', " "));
        }
        let mut checked = 0;
        for line in &lines {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let events = v["Events"].as_array().cloned().unwrap_or_default();
            for node in events
                .iter()
                .filter_map(|e| e.pointer("/Payload/Allocation/NodeID"))
                .filter_map(|n| n.as_str())
            {
                let want: Vec<String> = events
                    .iter()
                    .filter(|e| e["Topic"] == "Allocation")
                    .filter(|e| e.pointer("/Payload/Allocation/NodeID") == Some(&node.into()))
                    .map(|e| {
                        e["Payload"]["Allocation"]["ID"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    })
                    .collect();
                let Line::Frame {
                    index, allocations, ..
                } = decode_line(line.as_bytes(), node, 1 << 24).unwrap()
                else {
                    panic!("not a frame: {line}")
                };
                assert_eq!(index, v["Index"].as_u64().unwrap());
                let got: Vec<String> = allocations
                    .iter()
                    .map(|a| a.allocation.id.to_string())
                    .collect();
                assert_eq!(got, want);
                checked += 1;
            }
            // Every truncation is an error or a frame, never a panic.
            for cut in (0..line.len()).step_by(7) {
                let _ = decode_line(&line.as_bytes()[..cut], "n", 1 << 24);
            }
        }
        assert!(checked >= 10, "{checked}");
    }
}
