//! ACLs: 403 "Permission denied", policies and tokens, workload identities as tokens with
//! implicit variable access and job-attached policies.

mod common;
use common::{Sim, Stream};
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;

const ROOT: &str = "0b1d2a3c-0000-4000-8000-000000000001";

const BINDER_POLICY: &str = r#"
namespace "*" {
  capabilities = ["read-job", "host-volume-register", "host-volume-read", "host-volume-delete"]
  variables {
    path "dhv-binder/*" {
      capabilities = ["read", "write", "list", "destroy"]
    }
  }
}
node {
  policy = "read"
}
agent {
  policy = "read"
}
"#;

#[tokio::test(flavor = "multi_thread")]
async fn acl_tokens_policies_and_workload_identities() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(&format!("acl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\nclient \"node-1\" {{}}\n")).await;
        let root = Some(ROOT);
        let n1 = sim.node_id("node-1");
        let (s, _, b) = sim.req(Method::GET, "/v1/nodes", None).await;
        assert_eq!((s, b.as_str()), (403, "Permission denied"));
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/nodes", None, root).await;
        assert_eq!(s, 200);
        let (s, _, _) = sim.req(Method::GET, "/v1/event/stream?topic=Allocation", None).await;
        assert_eq!(s, 403);
        let (s, _, _) = sim.req(Method::GET, "/.well-known/jwks.json", None).await;
        assert_eq!(s, 200, "JWKS is public");

        // A read-only client token.
        let (s, _, b) = sim
            .req_tok(Method::PUT, "/v1/acl/policy/readonly", Some(json!({"Name": "readonly", "Rules": "namespace \"default\" { policy = \"read\" }"})), root)
            .await;
        assert_eq!(s, 200, "{b}");
        let (_, _, b) = sim.req_tok(Method::PUT, "/v1/acl/token", Some(json!({"Name": "ro", "Type": "client", "Policies": ["readonly"]})), root).await;
        let ro: Value = serde_json::from_str(&b).unwrap();
        let ro = ro["SecretID"].as_str().unwrap().to_string();
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/jobs", None, Some(&ro)).await;
        assert_eq!(s, 200);
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/jobs", Some(json!({"Job": {"ID": "x", "TaskGroups": []}})), Some(&ro)).await;
        assert_eq!(s, 403);
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/nodes", None, Some(&ro)).await;
        assert_eq!(s, 403);
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/acl/policy/x", Some(json!({"Rules": ""})), Some(&ro)).await;
        assert_eq!(s, 403);

        // The dhv-binder policy attached to job "wi" applies to its workload identity.
        let (s, _, b) = sim
            .req_tok(Method::PUT, "/v1/acl/policy/dhv-binder", Some(json!({"Name": "dhv-binder", "Rules": BINDER_POLICY,
                "JobACL": {"Namespace": "default", "JobID": "wi"}})), root)
            .await;
        assert_eq!(s, 200, "{b}");
        let hcl = r#"job "wi" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      identity {
        env = true
      }
      config {
        command = "/bin/sh"
        args = ["-c", "printf %s \"$NOMAD_TOKEN\" > $NOMAD_ALLOC_DIR/tok; exec sleep 1000"]
      }
    }
  }
}"#;
        let (_, _, parsed) = sim.req_tok(Method::POST, "/v1/jobs/parse", Some(json!({"JobHCL": hcl, "Canonicalize": true})), root).await;
        let job: Value = serde_json::from_str(&parsed).unwrap();
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/jobs", Some(json!({"Job": job})), root).await;
        assert_eq!(s, 200);
        let tok_path = sim
            .wait_for(20, "token file", || async {
                let (_, _, b) = sim.req_tok(Method::GET, "/v1/job/wi/allocations", None, root).await;
                let l: Value = serde_json::from_str(&b).ok()?;
                let id = l.get(0)?["ID"].as_str()?.to_string();
                let p = sim.nodes[0].3.join("alloc").join(&id).join("alloc/tok");
                std::fs::metadata(&p).ok().filter(|m| m.len() > 0).map(|_| p)
            })
            .await;
        let wi_raw = std::fs::read_to_string(&tok_path).unwrap();
        let wi = Some(wi_raw.as_str());
        // Implicit access to nomad/jobs/<job>: read allowed (404 = not found, not 403).
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/var/nomad/jobs/wi", None, wi).await;
        assert_eq!(s, 404);
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/var/nomad/jobs/wi", Some(json!({"Items": {"a": "b"}})), wi).await;
        assert_eq!(s, 403, "implicit access is read/list only");
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/var/other/thing", None, wi).await;
        assert_eq!(s, 403);
        // Policy-granted access.
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/var/dhv-binder/claims/a", Some(json!({"Items": {"a": "b"}})), wi).await;
        assert_eq!(s, 200);
        // Issue 11 #10: a lock is shown to its holder's apply answer and to management
        // tokens only (`Variables.Read`/`List`, `makeVariablesApplyResponse`).
        let (s, _, b) = sim
            .req_tok(Method::PUT, "/v1/var/dhv-binder/claims/l?lock-acquire", Some(json!({"Items": {"node_id": "n"}})), root)
            .await;
        assert_eq!(s, 200, "{b}");
        let (_, _, b) = sim.req_tok(Method::GET, "/v1/var/dhv-binder/claims/l", None, wi).await;
        let v: Value = serde_json::from_str(&b).unwrap();
        assert!(v.get("Lock").is_none(), "{b}");
        assert_eq!(v["Items"]["node_id"], "n", "the holder is named by the Items");
        let (_, _, b) = sim.req_tok(Method::GET, "/v1/vars?prefix=dhv-binder/claims/l", None, wi).await;
        assert!(!b.contains("\"Lock\""), "{b}");
        let (_, _, b) = sim.req_tok(Method::GET, "/v1/var/dhv-binder/claims/l", None, root).await;
        assert!(serde_json::from_str::<Value>(&b).unwrap()["Lock"]["ID"].is_string(), "{b}");
        let (s, _, _) = sim.req_tok(Method::GET, &format!("/v1/node/{n1}/allocations"), None, wi).await;
        assert_eq!(s, 200);
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/agent/self", None, wi).await;
        assert_eq!(s, 200);
        let dir = sim.path().join("hv");
        std::fs::create_dir_all(&dir).unwrap();
        let (s, _, b) = sim.req_tok(Method::PUT, "/v1/volume/host/register", Some(json!({"Volume": {"Name": "v", "NodeID": n1, "HostPath": dir}})), wi).await;
        assert_eq!(s, 200, "{b}");
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/jobs", Some(json!({"Job": job})), wi).await;
        assert_eq!(s, 403);
        let resp = sim.http.get(format!("{}/v1/event/stream?topic=Allocation&namespace=*", sim.server)).header("X-Nomad-Token", wi_raw.as_str()).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        drop(resp);
        // Once the alloc is client-terminal the identity is no longer accepted.
        let (s, _, _) = sim.req_tok(Method::DELETE, "/v1/job/wi", None, root).await;
        assert_eq!(s, 200);
        sim.wait_for(20, "token rejected after stop", || async {
            let (s, _, _) = sim.req_tok(Method::GET, "/v1/var/dhv-binder/claims/a", None, wi).await;
            (s == 403).then_some(())
        })
        .await;
    })
    .await
    .expect("test timed out");
}

/// `handleACLUpdates` (`nomad/stream/event_broker.go`): deleting a token closes the streams
/// that use it; a policy change re-authorizes every subscription and closes those that lost
/// the permission; others stay open. ACL objects emit ACLToken/ACLPolicy events.
#[tokio::test(flavor = "multi_thread")]
async fn event_stream_closed_when_token_or_policy_changes() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(&format!("event_heartbeat_interval = \"1s\"\nacl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\nclient \"node-1\" {{}}\n")).await;
        let root = Some(ROOT);
        let policy = |rules: &str| json!({"Name": "alloc-read", "Rules": rules});
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/acl/policy/alloc-read", Some(policy("namespace \"default\" { policy = \"read\" }")), root).await;
        assert_eq!(s, 200);
        let mut tokens = vec![];
        for name in ["t1", "t2"] {
            let (_, _, b) = sim.req_tok(Method::PUT, "/v1/acl/token", Some(json!({"Name": name, "Type": "client", "Policies": ["alloc-read"]})), root).await;
            let t: Value = serde_json::from_str(&b).unwrap();
            tokens.push((t["AccessorID"].as_str().unwrap().to_string(), t["SecretID"].as_str().unwrap().to_string()));
        }
        let mut acl_events = Stream::open_tok(&sim, "topic=ACLToken&topic=ACLPolicy", root).await;
        let mut s1 = Stream::open_tok(&sim, "topic=Allocation", Some(&tokens[0].1)).await;
        let mut s2 = Stream::open_tok(&sim, "topic=Allocation", Some(&tokens[1].1)).await;
        let mut admin = Stream::open_tok(&sim, "topic=Allocation", root).await;
        for s in [&mut s1, &mut s2, &mut admin] {
            assert_eq!(s.next(5).await, Some(json!({})));
        }
        // Token t1 deleted → its stream closes, t2's stays.
        let (s, _, _) = sim.req_tok(Method::DELETE, &format!("/v1/acl/token/{}", tokens[0].0), None, root).await;
        assert_eq!(s, 200);
        assert!(s1.closes_within(5).await, "stream of the deleted token still open");
        assert!(!s2.closes_within(2).await, "stream of another token closed");
        let (s, _, _) = sim.req_tok(Method::GET, "/v1/event/stream?topic=Allocation", None, Some(&tokens[0].1)).await;
        assert_eq!(s, 403, "deleted token refused at subscribe");
        // A policy change that keeps read-job: stream stays; one that drops it: stream closes.
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/acl/policy/alloc-read", Some(policy("namespace \"default\" { policy = \"read\" }\nnode { policy = \"read\" }")), root).await;
        assert_eq!(s, 200);
        assert!(!s2.closes_within(2).await, "stream closed though the token still may read");
        let (s, _, _) = sim.req_tok(Method::PUT, "/v1/acl/policy/alloc-read", Some(policy("node { policy = \"read\" }")), root).await;
        assert_eq!(s, 200);
        assert!(s2.closes_within(5).await, "stream still open after losing read-job");
        assert!(!admin.closes_within(2).await, "management stream closed");
        // ACL events: Key = AccessorID / policy name, no SecretID in payloads.
        let mut seen = vec![];
        while let Some(f) = acl_events.frame(2).await {
            for e in f["Events"].as_array().unwrap() {
                if e["Topic"] == "ACLToken" {
                    assert_eq!(e["Key"], e["Payload"]["ACLToken"]["AccessorID"]);
                    assert_eq!(e["Payload"]["ACLToken"]["SecretID"], "");
                }
                seen.push(format!("{}:{}", e["Topic"].as_str().unwrap(), e["Type"].as_str().unwrap()));
            }
        }
        for want in ["ACLToken:ACLTokenUpserted", "ACLToken:ACLTokenDeleted", "ACLPolicy:ACLPolicyUpserted"] {
            assert!(seen.iter().any(|s| s == want), "{want} missing in {seen:?}");
        }
    })
    .await
    .expect("test timed out");
}

/// `Variables.List` resolves the token once, before it blocks (`nomad/variables_endpoint.go`
/// `List`: `ResolveACL`, then `blockingRPC` filtering with that ACL object): an unknown token
/// is refused at once (it used to get `200 []`), and a token deleted while its query blocks
/// still gets the list its policy allowed (it used to wake to an empty list, which a client
/// reads as "every record deleted").
#[tokio::test(flavor = "multi_thread")]
async fn a_variables_list_resolves_its_token_before_it_blocks() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(&format!("acl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\nclient \"node-1\" {{}}\n")).await;
        let root = Some(ROOT);
        let (s, _, b) = sim
            .req_tok(Method::PUT, "/v1/acl/policy/dhv-binder", Some(json!({"Name": "dhv-binder", "Rules": BINDER_POLICY})), root)
            .await;
        assert_eq!(s, 200, "{b}");
        let (_, _, b) = sim
            .req_tok(Method::PUT, "/v1/acl/token", Some(json!({"Name": "d", "Type": "client", "Policies": ["dhv-binder"]})), root)
            .await;
        let t: Value = serde_json::from_str(&b).unwrap();
        let (secret, accessor) = (
            t["SecretID"].as_str().unwrap().to_string(),
            t["AccessorID"].as_str().unwrap().to_string(),
        );
        let put = |name: &str| json!({"Namespace": "default", "Path": format!("dhv-binder/volumes/{name}"), "Items": {"k": "v"}});
        let (s, _, b) = sim.req_tok(Method::PUT, "/v1/var/dhv-binder/volumes/a", Some(put("a")), root).await;
        assert_eq!(s, 200, "{b}");
        let (s, idx, b) = sim.req_tok(Method::GET, "/v1/vars?prefix=dhv-binder/", None, Some(&secret)).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(serde_json::from_str::<Value>(&b).unwrap().as_array().map(Vec::len), Some(1), "{b}");

        // A blocking list with the token, which is deleted while it waits.
        let (http, url, tok) = (
            sim.http.clone(),
            format!("{}/v1/vars?prefix=dhv-binder/&index={idx}&wait=20s", sim.server),
            secret.clone(),
        );
        let waiting = tokio::spawn(async move {
            let r = http.get(url).header("X-Nomad-Token", tok).send().await.expect("request");
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (s, _, b) = sim.req_tok(Method::DELETE, &format!("/v1/acl/token/{accessor}"), None, root).await;
        assert_eq!(s, 200, "{b}");
        let (s, _, b) = sim.req_tok(Method::PUT, "/v1/var/dhv-binder/volumes/b", Some(put("b")), root).await;
        assert_eq!(s, 200, "{b}");
        let (s, b) = waiting.await.unwrap();
        assert_eq!(s, 200, "{b}");
        let list: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(list.as_array().map(Vec::len), Some(2), "the woken list: {b}");

        // The next request with the deleted token is refused, not answered with nothing.
        let (s, _, b) = sim.req_tok(Method::GET, "/v1/vars?prefix=dhv-binder/", None, Some(&secret)).await;
        assert_eq!(s, 403, "{b}");
    })
    .await
    .expect("test timed out");
}

/// Issue 45 #1: `GET /v1/volumes?type=host&namespace=*` answers as Nomad's
/// `nomad/host_volume_endpoint.go` `HostVolume.List`: the selector checks the request's
/// namespace (`*`), which `acl/acl.go` `AllowNamespaceOperation` allows when any namespace
/// grants `host-volume-read`, so a token with it in `default` only is shown every
/// namespace's volumes (a foreign one is then 403 by ID, `HostVolume.Get`); a namespace the
/// token may not read, or `*` for a token with the capability nowhere, lists nothing (200
/// `[]`, never 403). The simulator used to refuse the whole `*` list with 403 as soon as one
/// existing namespace lacked the capability.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_volume_list_of_every_namespace_checks_the_wildcard_only() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(&format!("acl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\nclient \"node-1\" {{}}\n")).await;
        let root = Some(ROOT);
        let n1 = sim.node_id("node-1");
        let (s, _, b) = sim.req_tok(Method::PUT, "/v1/namespace/team-b", Some(json!({"Name": "team-b"})), root).await;
        assert_eq!(s, 200, "{b}");
        let mut ids = Vec::new();
        for ns in ["default", "team-b"] {
            let path = sim.path().join(format!("vol-{ns}"));
            std::fs::create_dir_all(&path).unwrap();
            let (s, _, b) = sim
                .req_tok(Method::PUT, "/v1/volume/host/register", Some(json!({"Volume": {"Namespace": ns, "Name": format!("data-{ns}"), "NodeID": n1, "HostPath": path}})), root)
                .await;
            assert_eq!(s, 200, "{b}");
            let v: Value = serde_json::from_str(&b).unwrap();
            ids.push(v["Volume"]["ID"].as_str().unwrap().to_string());
        }
        let token_of = |name: &'static str, rules: &'static str| {
            let sim = &sim;
            async move {
                let (s, _, b) = sim.req_tok(Method::PUT, &format!("/v1/acl/policy/{name}"), Some(json!({"Name": name, "Rules": rules})), root).await;
                assert_eq!(s, 200, "{b}");
                let (_, _, b) = sim.req_tok(Method::PUT, "/v1/acl/token", Some(json!({"Name": name, "Type": "client", "Policies": [name]})), root).await;
                serde_json::from_str::<Value>(&b).unwrap()["SecretID"].as_str().unwrap().to_string()
            }
        };
        let reader = token_of("default-reader", "namespace \"default\" {\n  capabilities = [\"host-volume-read\"]\n}\n").await;
        let nobody = token_of("jobs-only", "namespace \"default\" {\n  capabilities = [\"read-job\"]\n}\n").await;
        let names = |b: &str| -> Vec<String> {
            let l: Value = serde_json::from_str(b).unwrap();
            let mut v: Vec<String> = l.as_array().unwrap().iter().map(|v| v["Namespace"].as_str().unwrap().to_string()).collect();
            v.sort();
            v
        };
        let (s, _, b) = sim.req_tok(Method::GET, "/v1/volumes?type=host&namespace=*", None, Some(&reader)).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(names(&b), ["default", "team-b"], "every namespace's volumes: {b}");
        let (s, _, b) = sim.req_tok(Method::GET, &format!("/v1/volumes?type=host&namespace=*&node_id={n1}"), None, Some(&reader)).await;
        assert_eq!((s, names(&b)), (200, vec!["default".to_string(), "team-b".to_string()]), "{b}");
        let (s, _, b) = sim.req_tok(Method::GET, "/v1/volumes?type=host&namespace=team-b", None, Some(&reader)).await;
        assert_eq!((s, b.trim()), (200, "[]"), "a namespace the token may not read lists nothing");
        let (s, _, b) = sim.req_tok(Method::GET, &format!("/v1/volume/host/{}?namespace=team-b", ids[1]), None, Some(&reader)).await;
        assert_eq!((s, b.as_str()), (403, "Permission denied"), "the foreign volume by ID");
        let (s, _, b) = sim.req_tok(Method::GET, &format!("/v1/volume/host/{}?namespace=default", ids[0]), None, Some(&reader)).await;
        assert_eq!(s, 200, "{b}");
        let (s, _, b) = sim.req_tok(Method::GET, "/v1/volumes?type=host&namespace=*", None, Some(&nobody)).await;
        assert_eq!((s, b.trim()), (200, "[]"), "no namespace grants host-volume-read");
        let (s, _, b) = sim.req_tok(Method::GET, "/v1/volumes?type=host&namespace=*", None, Some("0b1d2a3c-0000-4000-8000-0000000000ff")).await;
        assert_eq!((s, b.as_str()), (403, "Permission denied"), "an unknown token");
    })
    .await
    .expect("test timed out");
}
