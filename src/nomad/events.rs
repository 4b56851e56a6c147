//! Event stream frames, decoded lazily.
//!
//! Nomad API: `GET /v1/event/stream` sends NDJSON: `{}` heartbeats and frames
//! `{"Index":N,"Events":[{"Topic","Type","Key","Namespace","FilterKeys","Index","Payload"}]}`.
//! The stream has no per-node filter (nomad-facts.md §1), so every daemon sees every
//! allocation event of the cluster. [`decode_line`] reads only the envelope and the
//! allocation's `NodeID`; the rest of a payload is decoded only for this node's allocations.

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
struct NodeOnlyPayload<'a> {
    #[serde(rename = "Allocation", borrow, default)]
    allocation: Option<NodeOnly<'a>>,
}

#[derive(Deserialize)]
struct NodeOnly<'a> {
    #[serde(rename = "NodeID", borrow, default)]
    node_id: Option<std::borrow::Cow<'a, str>>,
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
        let probe: NodeOnlyPayload = serde_json::from_str(payload.get())?;
        let mine = probe
            .allocation
            .and_then(|a| a.node_id)
            .is_some_and(|n| n == node_id);
        if !mine {
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
}
