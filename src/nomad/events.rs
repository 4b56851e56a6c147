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

use super::types::Allocation;
use serde::Deserialize;
use serde_json::value::RawValue;

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
    },
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
    /// The line exceeds the configured limit.
    #[error("event stream line of {0} bytes exceeds the limit")]
    TooLong(usize),
}

#[derive(Deserialize)]
struct FrameEnvelope<'a> {
    #[serde(rename = "Index", default)]
    index: Option<u64>,
    #[serde(rename = "Events", borrow, default)]
    events: Option<Vec<EventEnvelope<'a>>>,
}

#[derive(Deserialize)]
struct EventEnvelope<'a> {
    #[serde(rename = "Topic", default)]
    topic: std::borrow::Cow<'a, str>,
    #[serde(rename = "Type", default)]
    event_type: std::borrow::Cow<'a, str>,
    #[serde(rename = "Payload", borrow, default)]
    payload: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct FullPayload {
    #[serde(rename = "Allocation")]
    allocation: Allocation,
}

/// Decodes one line of the stream, keeping only allocation events whose `NodeID` is `node_id`.
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
    let env: FrameEnvelope = serde_json::from_slice(trimmed)?;
    let (Some(index), Some(events)) = (env.index, env.events) else {
        return Ok(Line::Heartbeat);
    };
    let mut allocations = Vec::new();
    let mut skipped = 0;
    for ev in events {
        let Some(payload) = ev.payload.filter(|_| ev.topic == "Allocation") else {
            continue;
        };
        if !probe::node_id_is(payload.get().as_bytes(), node_id) {
            skipped += 1;
            continue;
        }
        let full: FullPayload = serde_json::from_str(payload.get())?;
        allocations.push(AllocationEvent {
            event_type: ev.event_type.into_owned(),
            allocation: full.allocation,
        });
    }
    Ok(Line::Frame {
        index,
        allocations,
        skipped,
    })
}

/// Reads `Allocation.NodeID` out of an event payload `{"Allocation":{…}}` that serde_json
/// has already validated, stopping at that key: the keys before it are skipped by bracket
/// and string matching, the keys after it are never looked at.
mod probe {
    fn ws(p: &[u8], mut i: usize) -> usize {
        while i < p.len() && matches!(p[i], b' ' | b'\n' | b'\r' | b'\t') {
            i += 1;
        }
        i
    }

    /// `p[i]` is `"`; returns the index after the closing quote.
    fn string_end(p: &[u8], mut i: usize) -> usize {
        i += 1;
        while i < p.len() {
            match p[i] {
                b'\\' => i += 2,
                b'"' => return i + 1,
                _ => i += 1,
            }
        }
        i
    }

    /// Returns the index after the value starting at `i`.
    fn value_end(p: &[u8], i: usize) -> usize {
        match p.get(i) {
            Some(b'"') => string_end(p, i),
            Some(b'{') | Some(b'[') => {
                let mut depth = 0usize;
                let mut j = i;
                while j < p.len() {
                    match p[j] {
                        b'"' => {
                            j = string_end(p, j);
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                return j + 1;
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                j
            }
            _ => {
                let mut j = i;
                while j < p.len()
                    && !matches!(p[j], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
                {
                    j += 1;
                }
                j
            }
        }
    }

    /// Finds the value of `key` in the object starting at `i`; returns its start index.
    fn find_key(p: &[u8], i: usize, key: &str) -> Option<usize> {
        let mut i = ws(p, i);
        if p.get(i) != Some(&b'{') {
            return None;
        }
        i += 1;
        loop {
            i = ws(p, i);
            if p.get(i) != Some(&b'"') {
                return None; // `}`: not found
            }
            let end = string_end(p, i);
            let raw = &p[i + 1..end - 1];
            let matches = if raw.contains(&b'\\') {
                serde_json::from_slice::<String>(&p[i..end]).is_ok_and(|k| k == key)
            } else {
                raw == key.as_bytes()
            };
            i = ws(p, end);
            i = ws(p, i + 1); // ':'
            if matches {
                return Some(i);
            }
            i = ws(p, value_end(p, i));
            if p.get(i) == Some(&b',') {
                i += 1;
            }
        }
    }

    /// True when the payload's `Allocation.NodeID` equals `node_id`.
    pub fn node_id_is(p: &[u8], node_id: &str) -> bool {
        let Some(a) = find_key(p, 0, "Allocation") else {
            return false;
        };
        let Some(v) = find_key(p, a, "NodeID") else {
            return false;
        };
        if p.get(v) != Some(&b'"') {
            return false; // null
        }
        let end = string_end(p, v);
        let raw = &p[v + 1..end - 1];
        if raw.contains(&b'\\') {
            serde_json::from_slice::<String>(&p[v..end]).is_ok_and(|n| n == node_id)
        } else {
            raw == node_id.as_bytes()
        }
    }
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

    /// The next complete line or dropped line, if any.
    pub fn next_piece(&mut self) -> Option<Piece> {
        match memchr::memchr(b'\n', &self.buf[self.scanned..]) {
            Some(p) => {
                let mut line = self.buf.split_to(self.scanned + p + 1);
                self.scanned = 0;
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
        } = decode_line(line, "me", 1 << 20).unwrap()
        else {
            panic!("expected a frame")
        };
        assert_eq!(index, 7);
        assert_eq!(skipped, 1);
        assert_eq!(allocations.len(), 1);
        assert_eq!(allocations[0].allocation.id, "a2");
        assert_eq!(allocations[0].event_type, "AllocationUpdated");
    }

    #[test]
    fn garbage_and_oversized_lines_are_errors() {
        assert!(matches!(
            decode_line(b"not json", "n", 1024),
            Err(LineError::Malformed(_))
        ));
        assert!(matches!(
            decode_line(&[b' '; 2048], "n", 1024),
            Err(LineError::TooLong(2048))
        ));
    }

    #[test]
    fn probe_reads_node_id_only() {
        let p = br#"{"Allocation":{"ID":"a","Namespace":"d","EvalID":"e\"x","Name":"j.g[0]","Metrics":{"X":[1,{"NodeID":"me"}]},"NodeID":"other","ClientStatus":"x"}}"#;
        assert!(probe::node_id_is(p, "other"));
        assert!(!probe::node_id_is(p, "me"));
        assert!(!probe::node_id_is(
            br#"{"Allocation":{"ID":"a","NodeID":null}}"#,
            "me"
        ));
        assert!(!probe::node_id_is(br#"{"Job":{"NodeID":"me"}}"#, "me"));
        assert!(probe::node_id_is(
            br#" { "Allocation" : { "ID" : 1.5e3 , "NodeID" : "m\u0065" } } "#,
            "me"
        ));
        // A truncated payload never panics.
        assert!(!probe::node_id_is(br#"{"Allocation":{"ID":"a"#, "me"));
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
}
