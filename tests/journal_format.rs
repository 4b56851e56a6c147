//! An upgrade starts the new agent on the journal the previous release wrote. Each format
//! version this build reads has a fixture under `testdata/journal/v<N>/` (the files as that
//! release wrote them, with `@NODE@` and `@STATE@` standing for the node ID and the state
//! directory); the agent is started on each and acts on its records. A journal of a newer,
//! unknown format (a downgrade) is refused with a message that says what to do, and left
//! untouched.

mod support;

use std::path::Path;
use support::cluster::{repo, Cluster};

/// Copies fixture `version` into `state`, filled in for `node` and `state`.
fn place_fixture(version: u32, node: &str, state: &Path) {
    let from = repo().join(format!("testdata/journal/v{version}"));
    std::fs::create_dir_all(state).unwrap();
    for e in std::fs::read_dir(&from).unwrap() {
        let e = e.unwrap();
        let text = std::fs::read_to_string(e.path()).unwrap();
        let text = text
            .replace("@NODE@", node)
            .replace("@STATE@", &state.display().to_string());
        std::fs::write(state.join(e.file_name()), text).unwrap();
    }
}

/// Stops node 0's agent and removes its state (journal, lock, guard), as a fresh install.
fn stop_and_clear(c: &mut Cluster) {
    c.kill_agent(0, nix::sys::signal::Signal::SIGTERM);
    let state = c.nodes[0].state_dir.clone();
    for name in ["journal.json", "journal.wal", "journal.log"] {
        let _ = std::fs::remove_file(state.join(name));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_reads_every_previous_format_and_refuses_a_newer_one() {
    let mut c = Cluster::start(1).await;
    let node = c.nodes[0].id.clone();
    let state = c.nodes[0].state_dir.clone();
    for version in [2, 1] {
        stop_and_clear(&mut c);
        place_fixture(version, &node, &state);
        c.start_agent(0);
        // The fixture's allocations are gone: the agent unpublishes each recorded volume
        // (the published one, and the one whose publish intent has no outcome), which it
        // can only do having read their records.
        let mut want = vec!["default/fixture-published"];
        if version == 2 {
            want.push("default/fixture-intent");
        }
        c.wait_for(
            30,
            &format!("the v{version} fixture's volumes unpublished"),
            || async {
                let done: Vec<String> = c
                    .journal(0)
                    .iter()
                    .filter(|e| e["event"] == "unpublish-done")
                    .filter_map(|e| e["volume"].as_str().map(str::to_string))
                    .collect();
                want.iter()
                    .all(|v| done.iter().any(|d| d == v))
                    .then_some(())
            },
        )
        .await;
        let stored = dhv_binder::node::journal::read_stored(&state).unwrap();
        assert!(stored.mounts.is_empty(), "{:?}", stored.mounts);
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(state.join("journal.json")).unwrap()).unwrap();
        assert_eq!(
            written["version"],
            dhv_binder::node::journal::VERSION,
            "rewritten in this build's format"
        );
    }

    // A newer format: refused, said clearly, left as it was.
    stop_and_clear(&mut c);
    place_fixture(2, &node, &state);
    let newer = dhv_binder::node::journal::VERSION + 1;
    let text = std::fs::read_to_string(state.join("journal.json"))
        .unwrap()
        .replace("\"version\":2", &format!("\"version\":{newer}"))
        // A newer format's records need not parse as this one's.
        .replace("\"mounts\":[", "\"mounts\":{\"new\":[")
        .replace("],\"users\"", "]},\"users\"");
    std::fs::write(state.join("journal.json"), &text).unwrap();
    let log_from = std::fs::metadata(&c.nodes[0].log).unwrap().len() as usize;
    c.start_agent(0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = c.nodes[0].agent.as_mut().unwrap().try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent did not exit on the newer journal"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(status.code(), Some(64), "EX_CONFIG: {status:?}");
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    let log = &log[log_from..];
    assert!(
        log.contains(&format!(
            "format version {newer}, written by a newer dhv-binder"
        )) && log.contains("run the newer release again"),
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(state.join("journal.json")).unwrap(),
        text,
        "left untouched"
    );
}
