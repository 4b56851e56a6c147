//! Event broker: ring buffer of frames and per-subscription filtering.
//!
//! Nomad: `nomad/stream/event_buffer.go` (ring of the last `event_buffer_size` raft indexes that
//! produced events, `StartAtClosest`), `nomad/stream/subscription.go` (`filter`,
//! `eventMatchesKey`).

use crate::structs::{Event, Frame};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

/// Ring buffer of published frames.
#[derive(Debug)]
pub struct Broker {
    cap: usize,
    frames: VecDeque<Arc<Frame>>,
    evicted_max: u64,
}

/// The subscriber's next frame was evicted ("event dropped from buffer").
#[derive(Debug, thiserror::Error)]
#[error("event dropped from buffer")]
pub struct Dropped;

impl Broker {
    /// A broker keeping `cap` frames.
    pub fn new(cap: usize) -> Self {
        Broker {
            cap: cap.max(1),
            frames: VecDeque::new(),
            evicted_max: 0,
        }
    }

    /// Appends a frame (events must be non-empty), evicting the oldest beyond capacity.
    pub fn publish(&mut self, frame: Frame) {
        if frame.Events.is_empty() {
            return;
        }
        self.frames.push_back(Arc::new(frame));
        while self.frames.len() > self.cap {
            if let Some(f) = self.frames.pop_front() {
                self.evicted_max = f.Index;
            }
        }
    }

    /// Drops every buffered frame (sim fault: index/buffer reset).
    pub fn reset(&mut self) {
        if let Some(f) = self.frames.back() {
            self.evicted_max = self.evicted_max.max(f.Index);
        }
        self.frames.clear();
    }

    /// The cursor (inclusive lowest index to deliver) for a subscription at `requested`:
    /// 0 or older than the buffer → oldest buffered; newer than the newest → the newest;
    /// otherwise the first buffered index ≥ requested. `current` is the store's latest index.
    pub fn start_cursor(&self, requested: u64, current: u64) -> u64 {
        let (Some(oldest), Some(newest)) = (self.frames.front(), self.frames.back()) else {
            return current.max(self.evicted_max) + 1;
        };
        if requested == 0 || requested < oldest.Index {
            oldest.Index
        } else if requested > newest.Index {
            newest.Index
        } else {
            requested
        }
    }

    /// Frames with `Index >= cursor`, or [`Dropped`] when one of them was evicted.
    pub fn frames_from(&self, cursor: u64) -> Result<Vec<Arc<Frame>>, Dropped> {
        if cursor <= self.evicted_max {
            return Err(Dropped);
        }
        Ok(self
            .frames
            .iter()
            .filter(|f| f.Index >= cursor)
            .cloned()
            .collect())
    }
}

/// What a subscription asked for.
#[derive(Debug, Clone)]
pub struct SubscriptionFilter {
    /// Topic → keys (`*` = any).
    pub topics: BTreeMap<String, Vec<String>>,
    /// Allowed namespaces, frozen at subscribe time.
    pub namespaces: BTreeSet<String>,
}

fn matches_key(ev: &Event, key: &str) -> bool {
    key == "*"
        || ev.Key == key
        || ev
            .FilterKeys
            .as_ref()
            .is_some_and(|fk| fk.iter().any(|k| k == key))
}

impl SubscriptionFilter {
    /// Events of `frame` this subscription receives (Nomad's duplicate quirk kept: an event is
    /// appended once per matching requested key).
    pub fn filter(&self, frame: &Frame) -> Vec<Event> {
        let mut out = Vec::new();
        for ev in &frame.Events {
            if !ev.Namespace.is_empty() && !self.namespaces.contains(&ev.Namespace) {
                continue;
            }
            if let Some(keys) = self.topics.get("*") {
                if keys.len() == 1 && keys[0] == "*" {
                    out.push(ev.clone());
                    continue;
                }
            }
            if let Some(keys) = self.topics.get(&ev.Topic) {
                for k in keys {
                    if matches_key(ev, k) {
                        out.push(ev.clone());
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(i: u64) -> Frame {
        Frame {
            Index: i,
            Events: vec![Event {
                Topic: "Allocation".into(),
                Key: format!("a{i}"),
                Namespace: "default".into(),
                FilterKeys: Some(vec!["job".into(), "".into()]),
                Index: i,
                ..Default::default()
            }],
        }
    }

    #[test]
    fn closest_and_eviction() {
        let mut b = Broker::new(3);
        for i in [2, 4, 6, 8] {
            b.publish(frame(i));
        }
        assert_eq!(b.start_cursor(0, 8), 4);
        assert_eq!(b.start_cursor(1, 8), 4);
        assert_eq!(b.start_cursor(6, 8), 6);
        assert_eq!(b.start_cursor(5, 8), 5);
        assert_eq!(b.frames_from(5).unwrap()[0].Index, 6);
        assert_eq!(b.start_cursor(100, 8), 8);
        assert!(b.frames_from(2).is_err());
    }

    #[test]
    fn filter_by_filter_key() {
        let f = SubscriptionFilter {
            topics: [("Allocation".to_string(), vec!["job".to_string()])].into(),
            namespaces: ["default".to_string()].into(),
        };
        assert_eq!(f.filter(&frame(1)).len(), 1);
        let g = SubscriptionFilter {
            topics: [("Allocation".to_string(), vec!["node".to_string()])].into(),
            namespaces: ["default".to_string()].into(),
        };
        assert!(g.filter(&frame(1)).is_empty());
    }
}
