//! The shell's own decisions, on tokio's paused clock, without root: commits that
//! queue while one is written are folded into one write, and their calls start only
//! once it is durable; the loop (shell and core together) wakes a failed publish
//! exactly at its retry table's delay.
use super::*;
use crate::node::journal::tests::rec;
use crate::node::journal::{EventKind, Journal, MountState};

fn shell(dir: &std::path::Path) -> (Shell, Journal) {
    let cfg = AgentConfig {
        watch_mode: crate::config::WatchMode::Poll,
        token_file: None,
        state_dir: dir.join("state"),
        socket: dir.join("api.sock"),
        plugin_dir: dir.join("plugins"),
        volumes_dir: Some(dir.join("volumes")),
        plugin_timeout: Duration::from_secs(10),
        stream_idle_timeout: Duration::from_secs(95),
        resync_interval: Duration::from_secs(300),
        record_relist: Duration::from_secs(300),
        tick: Duration::from_millis(200),
        plugin_rescan: Duration::from_secs(60),
        health_interval: Duration::from_secs(10),
        usage_interval: Duration::from_secs(60),
        check_interval: Duration::from_secs(300),
        max_parallel: 2,
        claim_ttl: Duration::from_secs(15),
        claim_lock_delay: Duration::from_secs(15),
        heartbeat_interval_max: Duration::from_secs(20),
        fallback_addresses: Vec::new(),
        claim_fence_margin: None,
        audiences: vec![],
        metrics_addr: None,
        log_format: Default::default(),
        record_keys: None,
        allow_unsigned_records: true,
        plugin_roots: vec![],
        max_volumes: vec![],
        secrets_path: crate::storage::secrets::DEFAULT_SECRETS_PATH.into(),
        vault_addr: None,
        vault_token: None,
        token_issuer: None,
        helper_cgroup: crate::config::HelperCgroupSetting::None,
        helper_memory_max: crate::config::MemoryMax(None),
        nomad_cgroup_parent: None,
        other_node_cgroups: vec![],
    };
    let (store, journal) = Store::open(&cfg.state_dir, "node-1").expect("journal");
    let client =
        Client::new(&crate::config::NomadConfig::plain("http://127.0.0.1:1")).expect("client");
    let node = NodeEnv {
        node_id: "node-1".into(),
        node_pool: "default".into(),
        volumes_dir: dir.join("volumes"),
        plugin_dir: cfg.plugin_dir.clone(),
    };
    let claims = ClaimSettings {
        ttl: cfg.claim_ttl,
        lock_delay: cfg.claim_lock_delay,
        fence_margin: cfg.fence_margin(),
    };
    (
        Shell::new(
            cfg,
            client,
            node,
            claims,
            store,
            Meter::new(crate::metrics::Metrics::new()),
        ),
        journal,
    )
}

/// A commit of one more change to the journal.
fn change(j: &mut Journal, state: MountState) -> Commit {
    j.set_mount(rec(state), EventKind::PublishIntent, None);
    j.take_commit().expect("a change")
}

/// Runs the shell's tasks until none is left; returns the core's inputs in order.
async fn drain(s: &mut Shell) -> Vec<Input> {
    let mut inputs = Vec::new();
    while let Some(done) = s.tasks.join_next().await {
        inputs.extend(s.on_report(done.expect("task")));
    }
    inputs
}

fn committed(inputs: &[Input]) -> Vec<u64> {
    inputs
        .iter()
        .filter_map(|i| match i {
            Input::Committed { seq, result } => {
                assert!(result.is_ok(), "{result:?}");
                Some(*seq)
            }
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn commits_queued_behind_a_write_are_folded_into_one_write() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, mut j) = shell(dir.path());
    let base = s.store.commits();
    let (c1, c2, c3) = (
        change(&mut j, MountState::Publishing),
        change(&mut j, MountState::Published),
        change(&mut j, MountState::Unpublishing),
    );
    let want = vec![c1.seq, c3.seq];
    s.perform(vec![Effect::Commit {
        commit: c1,
        then: vec![],
    }]);
    assert!(s.committing);
    s.perform(vec![
        Effect::Commit {
            commit: c2,
            then: vec![],
        },
        Effect::Commit {
            commit: c3,
            then: vec![],
        },
    ]);
    let inputs = drain(&mut s).await;
    assert_eq!(committed(&inputs), want, "c2 and c3 are one write");
    assert_eq!(s.store.commits() - base, 2);
    let (_, back) = Store::open(&dir.path().join("state"), "node-1").expect("reopen");
    assert_eq!(
        back.mounts().values().next().map(|m| m.state),
        Some(MountState::Unpublishing),
        "the folded write holds the latest state"
    );
}

fn unpublished(name: &str) -> Called {
    Called::unpublished_for_test(name)
}

/// Issue 10: plugin calls that finish while the mount table is being read share the
/// next read (one read per call made a burst of N cost N reads of N mounts); each call's
/// completion still reaches the core after a table read that started after it.
#[tokio::test]
async fn calls_finished_together_share_one_mount_table_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, _) = shell(dir.path());
    let mut inputs = Vec::new();
    for i in 0..5 {
        inputs.extend(s.on_report(Report::CallDone(unpublished(&format!("v{i}")))));
    }
    assert!(inputs.is_empty(), "no completion before its table read");
    assert!(s.after_calls.reading());
    inputs.extend(drain(&mut s).await);
    let tables = inputs
        .iter()
        .filter(|i| matches!(i, Input::MountTable(_)))
        .count();
    let done = inputs
        .iter()
        .filter(|i| matches!(i, Input::Done(_)))
        .count();
    assert_eq!(done, 5, "every call completes");
    assert_eq!(
        tables, 2,
        "the first call's read, then one for the four behind it"
    );
    assert!(
        matches!(inputs.first(), Some(Input::MountTable(_))),
        "a table read precedes the completions it serves"
    );
    assert!(!s.after_calls.reading() && s.after_calls.waiting() == 0);
}

#[tokio::test(start_paused = true)]
async fn a_commits_calls_start_only_once_it_is_durable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, mut j) = shell(dir.path());
    let c = change(&mut j, MountState::Publishing);
    let seq = c.seq;
    s.perform(vec![Effect::Commit {
        commit: c,
        then: vec![Effect::ReadMountTable],
    }]);
    assert!(!s.reading_mounts, "the call waits for the commit");
    let first = s
        .tasks
        .join_next()
        .await
        .expect("the commit")
        .expect("task");
    let inputs = s.on_report(first);
    assert_eq!(committed(&inputs), vec![seq]);
    assert!(s.reading_mounts, "started once durable");
    drain(&mut s).await;
}

/// The loop's turns on tokio's paused clock (every wait is a jump of the clock to the
/// next timer: no real sleep). The fingerprint is scripted (plugin `bind`, whose file
/// is missing, so its publish fails at once, without a process); everything else is
/// performed by the shell. The core retries the publish at its retry table's delay
/// (`STEP_RETRY`: 1 s, jitter ±20 %), woken by the shell then, and not on any of the
/// 200 ms ticks before it.
#[tokio::test(start_paused = true)]
async fn a_failed_publish_is_retried_at_its_backoff_and_not_before() {
    use crate::agent::effect::publishes;
    use crate::agent::reconcile::tests::{alloc, key, volume};
    use crate::agent::retry::STEP_RETRY;
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, journal) = shell(dir.path());
    let now = || tokio::time::Instant::now().into_std();
    let mut core = scripted_core(&s, journal, Duration::from_secs(60), now());
    let (mut src, _senders) = silent_sources(Duration::from_millis(200));
    let fingerprinted = bind_fingerprinted;
    // The volume and its allocation arrive with the mount table and the plugin.
    let mut next = vec![
        Input::MountTable(MountTable::default()),
        fingerprinted(),
        Input::Catalogue(
            [(
                key("d"),
                std::sync::Arc::new(volume("d", "multi-node-multi-writer")),
            )]
            .into_iter()
            .collect(),
        ),
        Input::Watch(WatchEvent::Relisted {
            allocs: vec![alloc("a1", &["d"], "pending", "run")],
            index: 1,
        }),
    ];
    let (mut decided, mut failed) = (Vec::new(), Vec::new());
    let mut turns_between = 0;
    let mut wake = None;
    let give_up = now() + Duration::from_secs(10);
    while decided.len() < 2 && now() < give_up {
        let inputs = match std::mem::take(&mut next) {
            v if v.is_empty() => s.next_inputs(&core, &mut src).await,
            v => v,
        };
        for i in &inputs {
            if let Input::Done(Completion::Published { result: Err(_), .. }) = i {
                failed.push(now());
            }
        }
        let e = core.handle_all(inputs, now());
        if publishes(&e) > 0 {
            decided.push(now());
        } else if failed.len() == 1 {
            turns_between += 1;
        }
        if failed.len() == 1 && wake.is_none() {
            wake = core.next_wakeup();
        }
        let (fp, e): (Vec<Effect>, Vec<Effect>) = e
            .into_iter()
            .partition(|e| matches!(e, Effect::Fingerprint { .. }));
        if !fp.is_empty() {
            next.push(fingerprinted());
        }
        s.perform(e);
    }
    assert_eq!(decided.len(), 2, "publish then one retry: {decided:?}");
    assert_eq!(failed.len(), 1, "the first publish failed: {failed:?}");
    let waited = decided[1] - failed[0];
    let (lo, hi) = (STEP_RETRY.base.mul_f64(0.8), STEP_RETRY.base.mul_f64(1.2));
    assert!(
        (lo..=hi).contains(&waited),
        "retried {waited:?} after the failure, not in {lo:?}..={hi:?}"
    );
    // The deadline the core announced after the failure; tokio's timer wheel rounds a
    // sleep up to the next millisecond.
    let wake = wake.expect("a wake-up after the failure");
    assert!(
        decided[1] >= wake && decided[1] - wake <= Duration::from_millis(1),
        "the shell woke at {:?}, not at the core's retry deadline {wake:?}",
        decided[1]
    );
    assert!(
        turns_between >= 3,
        "the 200 ms ticks before the retry passed without it ({turns_between} turns)"
    );
    drain(&mut s).await;
}

/// A writer of log lines into a shared buffer (the test's own subscriber).
#[derive(Clone, Default)]
struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Issue 45 #2: the loop (shell and core) against a Nomad that cannot be reached
/// (`127.0.0.1:1`), for 60 s of tokio's paused clock with a 200 ms tick: the placeholder
/// listing, which fails each time, is sent again after a growing backoff (1 s doubling,
/// ±20 %), and its failure is logged at most once a minute with a count. The code before
/// listed again at every tick and logged every failure: 301 listings and 301 WARN lines
/// in 60 s here (364 lines a minute on the cluster).
#[tokio::test(start_paused = true)]
async fn a_failing_placeholder_listing_backs_off_and_logs_once_a_minute() {
    use crate::agent::reconcile::tests::{key, volume};
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let _log = tracing::subscriber::set_default(subscriber);
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, journal) = shell(dir.path());
    let now = || tokio::time::Instant::now().into_std();
    let mut core = scripted_core(&s, journal, Duration::from_secs(600), now());
    let (mut src, _senders) = silent_sources(Duration::from_millis(200));
    let fingerprinted = bind_fingerprinted;
    let mut next = vec![
        Input::MountTable(MountTable::default()),
        fingerprinted(),
        Input::Catalogue(
            [(
                key("d"),
                std::sync::Arc::new(volume("d", "multi-node-multi-writer")),
            )]
            .into_iter()
            .collect(),
        ),
    ];
    let start = now();
    let mut listings = Vec::new();
    while now() < start + Duration::from_secs(60) {
        let inputs = match std::mem::take(&mut next) {
            v if v.is_empty() => s.next_inputs(&core, &mut src).await,
            v => v,
        };
        let e = core.handle_all(inputs, now());
        let (fp, e): (Vec<Effect>, Vec<Effect>) = e
            .into_iter()
            .partition(|e| matches!(e, Effect::Fingerprint { .. }));
        if !fp.is_empty() {
            next.push(fingerprinted());
        }
        listings.extend(
            e.iter()
                .filter(|e| matches!(e, Effect::ListPlaceholders { .. }))
                .map(|_| now() - start),
        );
        s.perform(e);
    }
    drain(&mut s).await;
    let text =
        String::from_utf8_lossy(&lines.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned();
    let warned = text
        .lines()
        .filter(|l| l.contains("cannot list this node's placeholder host volumes"))
        .count();
    eprintln!(
        "{} listings in 60 s at {listings:?}; {warned} WARN lines",
        listings.len()
    );
    assert!(
        (4..=8).contains(&listings.len()),
        "listings in 60 s at {listings:?}"
    );
    for w in listings.windows(3) {
        assert!(w[2] - w[1] > w[1] - w[0], "the waits grow: {listings:?}");
    }
    assert!((1..=2).contains(&warned), "{warned} WARN lines:\n{text}");
    assert!(
        text.contains("failures="),
        "each line counts the failures it stands for:\n{text}"
    );
}

/// A core for the scripted loop tests, with the shell's node, mount root and claim settings.
fn scripted_core(
    s: &Shell,
    journal: Journal,
    plugin_rescan: Duration,
    now: std::time::Instant,
) -> Core {
    Core::new(
        Settings {
            node: s.node.clone(),
            mount_root: s.cfg.mount_root(),
            plugin_rescan,
            claims: s.claims,
            health_interval: Duration::from_secs(10),
            heartbeat_interval_max: Duration::from_secs(20),
            seed: 1,
            max_volumes: Default::default(),
        },
        journal,
        now,
    )
}

/// The senders that keep [`silent_sources`]' channels open (nothing is ever sent on them).
type Senders = (
    mpsc::Sender<WatchEvent>,
    mpsc::Sender<Catalogue>,
    mpsc::Sender<crate::cluster::snapshot::Snapshots>,
    mpsc::Sender<crate::cluster::unpublish_request::Requests>,
    mpsc::Sender<Request2Agent>,
    mpsc::Sender<()>,
);

/// The loop's sources with every channel open and silent, and a tick every `every`.
fn silent_sources(every: Duration) -> (Sources, Senders) {
    let (watch_tx, watch) = mpsc::channel(1);
    let (catalogue_tx, catalogue) = mpsc::channel(1);
    let (snapshots_tx, snapshots) = mpsc::channel(1);
    let (unpublish_tx, unpublish) = mpsc::channel(1);
    let (api_tx, api) = mpsc::channel(1);
    let (plugins_tx, plugins) = mpsc::channel(1);
    let src = Sources {
        watch,
        catalogue,
        snapshots,
        unpublish,
        api,
        plugins,
        records_failing: tokio::sync::watch::channel(None).1,
        secrets: mpsc::channel(1).1,
        tick: ticker(every),
        every,
        later: None,
    };
    (
        src,
        (
            watch_tx,
            catalogue_tx,
            snapshots_tx,
            unpublish_tx,
            api_tx,
            plugins_tx,
        ),
    )
}

/// The scripted fingerprint: plugin `bind`, deferred, no optional operations.
fn bind_fingerprinted() -> Input {
    let fp = crate::storage::plugin::Fingerprint {
        version: "1".into(),
        deferred_bind: true,
        capabilities: Vec::new(),
        ..Default::default()
    };
    Input::Done(Completion::Plugins(
        [("bind".to_string(), Ok(fp))].into_iter().collect(),
    ))
}

/// Issue 50: a round of mount probes is one task that reports once (it was one task, and
/// one pass of the loop building the node's record anew, per mounted volume: 1,000 passes
/// every health interval at 1,000 volumes). Every probe's outcome still reaches the core.
#[tokio::test]
async fn a_round_of_mount_probes_reaches_the_core_as_one_report() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, _) = shell(dir.path());
    let probes: Vec<Effect> = (0..50)
        .map(|i| {
            let target = dir.path().join(format!("t{i}"));
            std::fs::create_dir(&target).expect("target");
            Effect::Probe {
                volume: VolumeKey {
                    namespace: "default".into(),
                    name: format!("v{i}").into(),
                },
                target,
            }
        })
        .collect();
    s.perform(probes);
    assert_eq!(s.tasks.len(), 1, "one task for the round");
    let done = s.tasks.join_next().await.expect("the round").expect("task");
    let inputs = s.on_report(done);
    let healthy = inputs
        .iter()
        .filter(|i| {
            matches!(
                i,
                Input::Done(Completion::Probed {
                    probe: crate::node::health::Probe::Healthy,
                    ..
                })
            )
        })
        .count();
    assert_eq!(healthy, 50, "every probe answered");
    assert!(s.tasks.is_empty());
}

/// After-pass work held back by its rate limit (the node's record, the usage task's
/// volumes) wakes the loop when it is due, long before the next tick.
#[tokio::test(start_paused = true)]
async fn work_held_back_by_its_rate_limit_wakes_the_loop_when_it_is_due() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut s, journal) = shell(dir.path());
    let now = || tokio::time::Instant::now().into_std();
    let core = scripted_core(&s, journal, Duration::from_secs(600), now());
    let (mut src, _senders) = silent_sources(Duration::from_secs(60));
    // The interval's first tick comes at once.
    let _ = s.next_inputs(&core, &mut src).await;
    let start = tokio::time::Instant::now();
    src.later = Some(start + spaced::EVERY);
    let inputs = s.next_inputs(&core, &mut src).await;
    assert!(
        inputs.iter().all(|i| matches!(i, Input::Tick)),
        "{inputs:?}"
    );
    assert_eq!(start.elapsed(), spaced::EVERY);
}
