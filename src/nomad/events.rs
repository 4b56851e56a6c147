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
    let mut allocations = Vec::new();
    let mut skipped = 0;
    let mut err = None;
    let index = scan::frame(trimmed, |topic, event_type, payload| {
        if topic != b"Allocation" || err.is_some() {
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
    })
}

/// A lazy scanner for frames: it finds the envelope's keys and each event's `Topic`, `Type`
/// and `Payload` by matching brackets and quotes (memchr), without validating or decoding
/// what it skips. Only this node's payloads are then decoded (and validated) by serde_json.
/// It never panics and never reads out of bounds on malformed input.
mod scan {
    /// Calls `each(topic, type, payload)` for every event of the frame `p` (the raw bytes
    /// of strings, unescaped only where they had escapes). Returns the frame's `Index`
    /// (`None` for `{}` or any object without `Index` and `Events`), or the byte offset
    /// where the structure broke.
    pub fn frame(
        p: &[u8],
        mut each: impl FnMut(&[u8], &[u8], &[u8]),
    ) -> Result<Option<u64>, usize> {
        let mut i = expect(p, ws(p, 0), b'{')?;
        let mut index = None;
        let mut saw_events = false;
        loop {
            i = ws(p, i);
            match p.get(i) {
                Some(b'}') => {
                    i += 1;
                    break;
                }
                Some(b'"') => {}
                _ => return Err(i),
            }
            let (key, after) = string(p, i)?;
            i = ws(p, expect(p, ws(p, after), b':')?);
            match key {
                b"Index" => {
                    let end = value_end(p, i)?;
                    index = std::str::from_utf8(&p[i..end])
                        .ok()
                        .and_then(|n| n.parse().ok());
                    if index.is_none() {
                        return Err(i);
                    }
                    i = end;
                }
                b"Events" if p.get(i) == Some(&b'[') => {
                    saw_events = true;
                    i = events(p, i, &mut each)?;
                }
                _ => i = value_end(p, i)?,
            }
            i = ws(p, i);
            if p.get(i) == Some(&b',') {
                i += 1;
            }
        }
        if ws(p, i) != p.len() {
            return Err(i);
        }
        Ok(index.filter(|_| saw_events))
    }

    fn events(
        p: &[u8],
        i: usize,
        each: &mut impl FnMut(&[u8], &[u8], &[u8]),
    ) -> Result<usize, usize> {
        let mut i = i + 1;
        loop {
            i = ws(p, i);
            match p.get(i) {
                Some(b']') => return Ok(i + 1),
                Some(b'{') => {}
                _ => return Err(i),
            }
            i += 1;
            let (mut topic, mut typ, mut payload): (&[u8], &[u8], &[u8]) = (b"", b"", b"");
            loop {
                i = ws(p, i);
                match p.get(i) {
                    Some(b'}') => {
                        i += 1;
                        break;
                    }
                    Some(b'"') => {}
                    _ => return Err(i),
                }
                let (key, after) = string(p, i)?;
                i = ws(p, expect(p, ws(p, after), b':')?);
                let end = value_end(p, i)?;
                match key {
                    b"Topic" if p[i] == b'"' => topic = &p[i + 1..end - 1],
                    b"Type" if p[i] == b'"' => typ = &p[i + 1..end - 1],
                    b"Payload" => payload = &p[i..end],
                    _ => {}
                }
                i = ws(p, end);
                if p.get(i) == Some(&b',') {
                    i += 1;
                }
            }
            if !payload.is_empty() {
                each(topic, typ, payload);
            }
            i = ws(p, i);
            if p.get(i) == Some(&b',') {
                i += 1;
            }
        }
    }

    fn expect(p: &[u8], i: usize, b: u8) -> Result<usize, usize> {
        if p.get(i) == Some(&b) {
            Ok(i + 1)
        } else {
            Err(i)
        }
    }

    /// The raw bytes of the string at `i` (a key: escapes left as they are; Nomad's keys
    /// have none) and the index after it.
    fn string(p: &[u8], i: usize) -> Result<(&[u8], usize), usize> {
        let end = string_end(p, i)?;
        Ok((&p[i + 1..end - 1], end))
    }
    fn ws(p: &[u8], mut i: usize) -> usize {
        while i < p.len() && matches!(p[i], b' ' | b'\n' | b'\r' | b'\t') {
            i += 1;
        }
        i
    }

    /// `p[i]` is `"`; returns the index after the closing quote.
    fn string_end(p: &[u8], i: usize) -> Result<usize, usize> {
        let mut j = i + 1;
        loop {
            match memchr::memchr2(b'"', b'\\', p.get(j..).ok_or(i)?) {
                Some(k) if p[j + k] == b'"' => return Ok(j + k + 1),
                Some(k) => j += k + 2,
                None => return Err(i),
            }
        }
    }

    /// Returns the index after the value starting at `i`. Inside an object only `{`, `}`
    /// and strings matter to find its end (and likewise for arrays).
    fn value_end(p: &[u8], i: usize) -> Result<usize, usize> {
        let (open, close) = match p.get(i) {
            Some(b'"') => return string_end(p, i),
            Some(b'{') => (b'{', b'}'),
            Some(b'[') => (b'[', b']'),
            Some(_) => {
                let mut j = i;
                while j < p.len()
                    && !matches!(p[j], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
                {
                    j += 1;
                }
                return if j == i { Err(i) } else { Ok(j) };
            }
            None => return Err(i),
        };
        // A plain byte loop: Nomad's JSON has a quote every few bytes, too dense for memchr.
        let mut depth = 0usize;
        let mut j = i;
        while j < p.len() {
            let b = p[j];
            if b == b'"' {
                j += 1;
                while j < p.len() {
                    match p[j] {
                        b'\\' => j += 2,
                        b'"' => break,
                        _ => j += 1,
                    }
                }
            } else if b == open {
                depth += 1;
            } else if b == close {
                depth -= 1;
                if depth == 0 {
                    return Ok(j + 1);
                }
            }
            j += 1;
        }
        Err(i)
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
            let end = string_end(p, i).ok()?;
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
            i = ws(p, value_end(p, i).ok()?);
            if p.get(i) == Some(&b',') {
                i += 1;
            }
        }
    }

    /// True when the payload's `Allocation.NodeID` equals `node_id`: reads the payload's
    /// keys up to `NodeID` only (the fifth key in Nomad's field order).
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
        let Ok(end) = string_end(p, v) else {
            return false;
        };
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
            Err(LineError::Syntax(_))
        ));
        assert!(matches!(
            decode_line(&[b' '; 2048], "n", 1024),
            Err(LineError::TooLong(2048))
        ));
    }

    #[test]
    fn probe_reads_node_id_only() {
        let p = br#"{"Allocation":{"ID":"a","Namespace":"d","EvalID":"e\"x","Name":"j.g[0]","Metrics":{"X":[1,{"NodeID":"me"}]},"NodeID":"other","ClientStatus":"x"}}"#;
        assert!(scan::node_id_is(p, "other"));
        assert!(!scan::node_id_is(p, "me"));
        assert!(!scan::node_id_is(
            br#"{"Allocation":{"ID":"a","NodeID":null}}"#,
            "me"
        ));
        assert!(!scan::node_id_is(br#"{"Job":{"NodeID":"me"}}"#, "me"));
        assert!(scan::node_id_is(
            br#" { "Allocation" : { "ID" : 1.5e3 , "NodeID" : "m\u0065" } } "#,
            "me"
        ));
        // A truncated payload never panics.
        assert!(!scan::node_id_is(br#"{"Allocation":{"ID":"a"#, "me"));
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
                    .map(|a| a.allocation.id.clone())
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
