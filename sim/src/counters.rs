//! The simulator's counting front: requests and response bytes per endpoint, over every
//! listener of one server (the servers' load, as benches and tests read it). Sim-only; Nomad
//! has no such endpoint (its nearest is the `nomad.http.*` telemetry timers, which count
//! requests but not bytes).
//!
//! Read with `GET /v1/sim/counters` (JSON object: method and route template such as `GET /v1/vars` →
//! `{"requests": n, "bytes": b}`, bytes = response body bytes, streamed bodies counted as
//! they are sent; a variable's requests also under `<method> /v1/var/<first two path
//! segments>`, e.g. `GET /v1/var/dhv-binder/records-changed`) or in-process with
//! [`Counters::snapshot`]; `PUT /v1/sim/counters/reset` zeroes them.

use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One endpoint's figures.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Count {
    /// Requests answered (any status).
    pub requests: u64,
    /// Response body bytes sent.
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct Cell {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// Requests and bytes per route template, shared by every listener of a server.
#[derive(Debug, Default, Clone)]
pub struct Counters(Arc<Mutex<BTreeMap<String, Arc<Cell>>>>);

/// A handle that adds bytes to one endpoint's count as a body streams out.
#[derive(Debug, Clone)]
pub struct ByteSink(Vec<Arc<Cell>>);

impl ByteSink {
    /// Adds `n` bytes.
    pub fn add(&self, n: usize) {
        for c in &self.0 {
            c.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

impl Counters {
    /// Counts one request to `route` and returns where its body's bytes go.
    pub fn request(&self, route: &str) -> ByteSink {
        self.request_under(&[route])
    }

    /// Counts one request under each of `keys` (a route and a finer key: variable requests
    /// also count under their path's first two segments, `GET /v1/var/dhv-binder/volumes`);
    /// the sink adds its bytes to each.
    pub fn request_under(&self, keys: &[&str]) -> ByteSink {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        ByteSink(
            keys.iter()
                .map(|k| {
                    let cell = m.entry(k.to_string()).or_default().clone();
                    cell.requests.fetch_add(1, Ordering::Relaxed);
                    cell
                })
                .collect(),
        )
    }

    /// The figures so far, by route template.
    pub fn snapshot(&self) -> BTreeMap<String, Count> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.iter()
            .map(|(k, c)| {
                (
                    k.clone(),
                    Count {
                        requests: c.requests.load(Ordering::Relaxed),
                        bytes: c.bytes.load(Ordering::Relaxed),
                    },
                )
            })
            .collect()
    }

    /// Zeroes every figure.
    pub fn reset(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_route_and_reset_clears() {
        let c = Counters::default();
        c.request("GET /v1/vars").add(10);
        c.request("GET /v1/vars").add(5);
        c.request("GET /v1/var/*path");
        let s = c.snapshot();
        assert_eq!(
            s["GET /v1/vars"],
            Count {
                requests: 2,
                bytes: 15
            }
        );
        assert_eq!(s["GET /v1/var/*path"].requests, 1);
        c.request_under(&["GET /v1/var/*path", "GET /v1/var/a/b"])
            .add(7);
        let s = c.snapshot();
        assert_eq!(
            s["GET /v1/var/*path"],
            Count {
                requests: 2,
                bytes: 7
            }
        );
        assert_eq!(
            s["GET /v1/var/a/b"],
            Count {
                requests: 1,
                bytes: 7
            }
        );
        c.reset();
        assert!(c.snapshot().is_empty());
    }
}
