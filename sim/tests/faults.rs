//! Sim-only event stream faults: close streams, leaderless cluster (500 "No cluster leader"),
//! buffer reset.

mod common;
use common::{Sim, Stream};
use reqwest::Method;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn close_leader_loss_and_reset() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        sim.put("/v1/var/a", json!({"Items": {"a": "1"}})).await;
        // Close: open streams end (EOF).
        let mut s = Stream::open(&sim, "topic=Variable").await;
        assert_eq!(s.next(5).await.unwrap(), json!({}));
        assert!(s.frame(5).await.is_some());
        sim.put("/v1/sim/events/close", json!({})).await;
        assert!(s.next(5).await.is_none(), "stream closed");

        // Leader loss: open streams close (their server went away); new ones are served by a
        // follower; other requests get 500 "No cluster leader" unless stale.
        let mut s = Stream::open(&sim, "topic=Variable").await;
        assert_eq!(s.next(5).await.unwrap(), json!({}));
        assert!(s.frame(5).await.is_some(), "index=0 replays the buffer");
        sim.put("/v1/sim/leader?leader=false", json!({})).await;
        assert!(s.frame(5).await.is_none());
        let mut during = Stream::open(&sim, "topic=Variable&index=0").await;
        assert_eq!(during.next(5).await.unwrap(), json!({}));
        assert!(during.frame(5).await.is_some(), "a follower serves streams");
        for path in ["/v1/nodes", "/v1/var/a", "/v1/allocations"] {
            let (st, _, body) = sim.req(Method::GET, path, None).await;
            assert_eq!((st, body.as_str()), (500, "No cluster leader"), "{path}");
        }
        let (st, _, _) = sim
            .req(Method::PUT, "/v1/var/x", Some(json!({"Items": {"a": "1"}})))
            .await;
        assert_eq!(st, 500, "writes need the leader");
        let (st, _, _) = sim.req(Method::GET, "/v1/nodes?stale", None).await;
        assert_eq!(st, 200, "stale reads are served");
        let (st, _, body) = sim.req(Method::GET, "/v1/status/leader", None).await;
        assert_eq!((st, body.as_str()), (200, "\"\""));
        sim.put("/v1/sim/leader?leader=true", json!({})).await;
        let mut s = Stream::open(&sim, "topic=Variable&index=0").await;
        assert!(
            s.frame(5).await.is_some(),
            "buffer survives a leader change"
        );

        // Reset (snapshot restore): streams close, the buffer is empty, old indexes are a silent gap.
        let before = sim.put("/v1/var/b", json!({"Items": {"b": "1"}})).await["ModifyIndex"]
            .as_u64()
            .unwrap();
        sim.put("/v1/sim/events/reset", json!({})).await;
        while s.frame(3).await.is_some() {}
        let mut s = Stream::open(&sim, &format!("topic=Variable&index={before}")).await;
        assert_eq!(s.next(5).await.unwrap(), json!({}));
        let after = sim.put("/v1/var/c", json!({"Items": {"c": "1"}})).await["ModifyIndex"]
            .as_u64()
            .unwrap();
        let f = s.frame(5).await.unwrap();
        assert_eq!(
            f["Index"].as_u64().unwrap(),
            after,
            "nothing before the reset is replayed"
        );
    })
    .await
    .expect("test timed out");
}
