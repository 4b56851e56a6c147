//! Variable locks: acquire, conflict, renew, release, TTL expiry with lock delay.

mod common;
use common::Sim;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread")]
async fn acquire_renew_release_and_ttl_expiry() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let spec = json!({"Items": {"owner": "a"}, "Lock": {"TTL": "1s", "LockDelay": "1s"}});
        let (s, _, b) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-acquire",
                Some(spec.clone()),
            )
            .await;
        assert_eq!(s, 200, "{b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        let id = v["Lock"]["ID"].as_str().unwrap().to_string();
        assert_eq!(v["Lock"]["TTL"], "1s");
        assert_eq!(v["Lock"]["LockDelay"], "1s");
        assert_eq!(v["Items"]["owner"], "a");
        // A second acquire conflicts; writes without the lock ID conflict; with it they succeed.
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-acquire",
                Some(spec.clone()),
            )
            .await;
        assert_eq!(s, 409);
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x",
                Some(json!({"Items": {"owner": "b"}})),
            )
            .await;
        assert_eq!(s, 409);
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x",
                Some(json!({"Items": {"owner": "a2"}, "Lock": {"ID": id}})),
            )
            .await;
        assert_eq!(s, 200);
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-acquire&cas=1",
                Some(spec.clone()),
            )
            .await;
        assert_eq!(s, 400, "cas cannot be combined with lock operations");
        // Renew keeps it past the TTL.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (s, _, b) = sim
                .req(
                    Method::PUT,
                    "/v1/var/leader/x?lock-renew",
                    Some(json!({"Lock": {"ID": id}})),
                )
                .await;
            assert_eq!(s, 200, "{b}");
        }
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-renew",
                Some(json!({"Lock": {"ID": "wrong"}})),
            )
            .await;
        assert_eq!(s, 409);
        // Release frees it at once.
        let (s, _, b) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-release",
                Some(json!({"Lock": {"ID": id}})),
            )
            .await;
        assert_eq!(s, 200, "{b}");
        assert!(sim.get("/v1/var/leader/x").await.get("Lock").is_none());
        let (s, _, b) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-acquire",
                Some(spec.clone()),
            )
            .await;
        assert_eq!(s, 200);
        let id2 = serde_json::from_str::<Value>(&b).unwrap()["Lock"]["ID"]
            .as_str()
            .unwrap()
            .to_string();
        assert_ne!(id, id2);
        // Not renewed: lock dropped after the TTL, then blocked for the lock delay.
        let t = Instant::now();
        sim.wait_for(5, "lock expiry", || async {
            sim.get("/v1/var/leader/x")
                .await
                .get("Lock")
                .is_none()
                .then_some(())
        })
        .await;
        assert!(t.elapsed() >= Duration::from_millis(800));
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-acquire",
                Some(spec.clone()),
            )
            .await;
        assert_eq!(s, 409, "lock delay in force");
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (s, _, _) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-acquire",
                Some(spec.clone()),
            )
            .await;
        assert_eq!(s, 200, "acquirable after the lock delay");
    })
    .await
    .expect("test timed out");
}
