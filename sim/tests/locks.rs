//! Variable locks over HTTP: acquire, conflict, renew, release. Expiry (2×TTL, then the lock
//! delay) is shown with a paused clock in `locks::tests` (sim/src/locks.rs).

mod common;
use common::Sim;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn acquire_renew_release() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let spec = json!({"Items": {"owner": "a"}, "Lock": {"TTL": "10s", "LockDelay": "1s"}});
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
        assert_eq!(v["Lock"]["TTL"], "10s");
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
        // Renew restarts its clock.
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
        // Release by its holder: Lock.ID only; Items, even `{}`, are refused.
        let (s, _, b) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-release",
                Some(json!({"Items": {}, "Lock": {"ID": id2}})),
            )
            .await;
        assert_eq!(s, 400, "{b}");
        assert!(
            b.contains("lock release operation doesn't take variable items"),
            "{b}"
        );
        let (s, _, b) = sim
            .req(
                Method::PUT,
                "/v1/var/leader/x?lock-release",
                Some(json!({"Lock": {"ID": id2}})),
            )
            .await;
        assert_eq!(s, 200, "{b}");
    })
    .await
    .expect("test timed out");
}
