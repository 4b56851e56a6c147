//! Query meta headers and errors as Nomad sends them: text/plain bodies, 400 on bad parameters,
//! 404 bodies, 405, the 500 on an unparsable `purge` (an uncoded error in `jobDelete`).

mod common;
use common::Sim;
use reqwest::Method;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn query_meta_headers_and_error_bodies() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        // X-Nomad-Index / KnownLeader / LastContact on reads (`setMeta`, command/agent/http.go).
        let r = sim.http.get(format!("{}/v1/nodes", sim.server)).send().await.unwrap();
        let h = r.headers();
        assert!(h["x-nomad-index"].to_str().unwrap().parse::<u64>().unwrap() > 0);
        assert_eq!(h["x-nomad-knownleader"], "true");
        assert_eq!(h["x-nomad-lastcontact"], "0");
        assert_eq!(h["content-type"], "application/json");

        let n1 = sim.node_id("node-1");
        let cases: Vec<(Method, String, Option<serde_json::Value>, u16, &str)> = vec![
            // parseWait (command/agent/http.go)
            (Method::GET, "/v1/nodes?index=abc".into(), None, 400, "Invalid index"),
            (Method::GET, "/v1/nodes?index=1&wait=soon".into(), None, 400, "Invalid wait time"),
            // event_endpoint.go
            (Method::GET, "/v1/event/stream?index=x".into(), None, 400, "Unable to parse index: strconv.Atoi: parsing \"x\": invalid syntax"),
            (Method::GET, "/v1/event/stream?topic=a:b:c".into(), None, 400, "Invalid topic query"),
            (Method::POST, "/v1/event/stream".into(), None, 405, "Invalid method"),
            // variable_endpoint.go
            (Method::PUT, "/v1/var/a?cas=x".into(), Some(json!({"Items": {"a": "b"}})), 400, "can not parse cas: strconv.ParseUint: parsing \"x\": invalid syntax"),
            (Method::PUT, "/v1/var/a".into(), Some(json!({"Items": {}})), 400, "variable missing required Items object"),
            (Method::PUT, "/v1/var/a?cas=1&lock-acquire".into(), Some(json!({"Items": {"a": "b"}})), 400, "CAS can't be used with lock operations"),
            (Method::GET, "/v1/var/nope?cas=x".into(), None, 404, "variable not found"),
            (Method::DELETE, "/v1/var/nope?cas=x".into(), None, 400, "can not parse cas"),
            // node_endpoint.go: decodeBody on an empty body
            (Method::PUT, format!("/v1/node/{n1}/drain"), None, 400, "Request body is empty"),
            (Method::GET, "/v1/node/00000000-0000-0000-0000-000000000000".into(), None, 404, "node not found"),
            // job / alloc endpoints
            (Method::GET, "/v1/job/nope".into(), None, 404, "job not found"),
            (Method::GET, "/v1/allocation/00000000-0000-0000-0000-000000000000".into(), None, 404, "alloc not found"),
            (Method::PUT, "/v1/jobs".into(), Some(json!({})), 400, "Job must be specified"),
            (Method::DELETE, "/v1/job/nope?purge=maybe".into(), None, 500, "Failed to parse value of \"purge\" (maybe) as a bool"),
        ];
        for (m, path, body, status, text) in cases {
            let (s, _, b) = sim.req(m.clone(), &path, body).await;
            assert_eq!(s, status, "{m} {path}: {b}");
            assert!(b.starts_with(text), "{m} {path}: body {b:?}, want {text:?}");
        }
        // Error bodies are text/plain.
        let r = sim.http.get(format!("{}/v1/job/nope", sim.server)).send().await.unwrap();
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
        // Go's strconv.ParseBool spellings for purge (python-nomad sends "True").
        for v in ["True", "1", "t"] {
            sim.run_job(&format!("job \"p{v}\" {{\n  group \"g\" {{\n    task \"t\" {{\n      driver = \"raw_exec\"\n      config {{\n        command = \"/bin/sleep\"\n        args = [\"100\"]\n      }}\n    }}\n  }}\n}}")).await;
            let (s, _, b) = sim.req(Method::DELETE, &format!("/v1/job/p{v}?purge={v}"), None).await;
            assert_eq!(s, 200, "{b}");
            let (s, _, _) = sim.req(Method::GET, &format!("/v1/job/p{v}"), None).await;
            assert_eq!(s, 404, "purge={v} purges");
        }
    })
    .await
    .expect("test timed out");
}

/// `GET /v1/allocation/:id` reads the exact ID (`Alloc.GetAlloc` → `AllocByID`): a prefix is
/// 404 "alloc not found"; the CLI resolves prefixes through `GET /v1/allocations?prefix=`.
#[tokio::test(flavor = "multi_thread")]
async fn an_allocation_is_read_by_its_exact_id_only() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let job = sim
            .run_job("job \"x\" {\n  group \"g\" {\n    task \"t\" {\n      driver = \"raw_exec\"\n      kill_timeout = \"1s\"\n      config {\n        command = \"/bin/sleep\"\n        args = [\"100\"]\n      }\n    }\n  }\n}")
            .await;
        let id = sim
            .wait_for(20, "an allocation", || async {
                sim.job_allocs(&job).await.first()?["ID"].as_str().map(String::from)
            })
            .await;
        let (s, _, _) = sim.req(Method::GET, &format!("/v1/allocation/{id}"), None).await;
        assert_eq!(s, 200);
        let (s, _, b) = sim
            .req(Method::GET, &format!("/v1/allocation/{}", &id[..8]), None)
            .await;
        assert_eq!((s, b.as_str()), (404, "alloc not found"));
        let list = sim.get(&format!("/v1/allocations?prefix={}", &id[..8])).await;
        assert_eq!(list[0]["ID"], id.as_str());
    })
    .await
    .expect("test timed out");
}
