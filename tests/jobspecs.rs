//! The files in jobspecs/ are real Nomad jobspecs and specs: each is parsed with hcl-rs and
//! checked for the fields Nomad requires and the wiring dhv-binder depends on.

use hcl::{Block, Body, Expression};
use std::path::PathBuf;

fn read(name: &str) -> Body {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("jobspecs")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    hcl::parse(&text).unwrap_or_else(|e| panic!("{} is not valid HCL: {e}", path.display()))
}

fn blocks<'a>(body: &'a Body, ident: &str) -> Vec<&'a Block> {
    body.blocks().filter(|b| b.identifier() == ident).collect()
}

fn one<'a>(body: &'a Body, ident: &str) -> &'a Block {
    let b = blocks(body, ident);
    assert_eq!(b.len(), 1, "expected exactly one {ident} block");
    b[0]
}

fn attr<'a>(body: &'a Body, key: &str) -> Option<&'a Expression> {
    body.attributes().find(|a| a.key() == key).map(|a| a.expr())
}

fn string(body: &Body, key: &str) -> String {
    match attr(body, key) {
        Some(Expression::String(s)) => s.clone(),
        other => panic!("{key} should be a string, got {other:?}"),
    }
}

fn label(b: &Block) -> String {
    assert_eq!(b.labels().len(), 1, "{} needs one label", b.identifier());
    b.labels()[0].as_str().to_string()
}

/// Checks what Nomad requires of every job: one labelled job, groups with labels, tasks
/// with a driver and a config, volume_mounts naming a group volume.
fn check_job(body: &Body) -> &Block {
    let job = one(body, "job");
    assert!(!label(job).is_empty());
    let groups = blocks(job.body(), "group");
    assert!(!groups.is_empty(), "a job needs a group");
    for g in &groups {
        label(g);
        let vols: Vec<String> = blocks(g.body(), "volume").into_iter().map(label).collect();
        for v in blocks(g.body(), "volume") {
            assert_eq!(string(v.body(), "type"), "host");
            assert!(!string(v.body(), "source").is_empty());
        }
        let tasks = blocks(g.body(), "task");
        assert!(!tasks.is_empty(), "group {} needs a task", label(g));
        for t in tasks {
            label(t);
            assert!(!string(t.body(), "driver").is_empty());
            one(t.body(), "config");
            for vm in blocks(t.body(), "volume_mount") {
                let v = string(vm.body(), "volume");
                assert!(vols.contains(&v), "volume_mount names unknown volume {v}");
                assert!(string(vm.body(), "destination").starts_with('/'));
            }
        }
    }
    job
}

#[test]
fn system_job_runs_the_agent_on_every_client() {
    let body = read("dhv-binder.nomad.hcl");
    let job = check_job(&body);
    assert_eq!(string(job.body(), "type"), "system");
    let task = one(one(job.body(), "group").body(), "task");
    assert_eq!(
        string(task.body(), "driver"),
        "raw_exec",
        "mounts must land in the host namespace"
    );
    let env = one(task.body(), "env");
    // The socket's directory is the static host volume: persistent, never tmpfs (a Nomad
    // client refuses to start when a static host_volume path is missing after a reboot).
    let socket = string(env.body(), "DHV_BINDER_SOCKET");
    assert_eq!(socket, "/var/lib/dhv-binder/socket/api.sock");
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("jobspecs/dhv-binder.nomad.hcl"),
    )
    .unwrap();
    assert!(
        text.contains("path      = \"/var/lib/dhv-binder/socket\""),
        "the documented client host_volume path matches the socket's directory"
    );

    let identity = one(task.body(), "identity");
    assert_eq!(attr(identity.body(), "env"), Some(&Expression::Bool(true)));
    // The release is fetched, checked against its SHA-256, and run from the task dir.
    let artifact = one(task.body(), "artifact");
    assert!(attr(artifact.body(), "source").is_some());
    let checksum = attr(one(artifact.body(), "options").body(), "checksum");
    assert!(
        checksum.is_some_and(|c| c.to_string().contains("sha256:")),
        "the artifact needs options {{ checksum = \"sha256:...\" }}, got {checksum:?}"
    );
    assert!(string(one(task.body(), "config").body(), "command").starts_with("local/"));
    // The Task API socket: no address or TLS files to configure.
    let addr = attr(env.body(), "NOMAD_ADDR").map(|e| e.to_string());
    assert!(
        addr.as_deref()
            .is_some_and(|a| a.contains("unix://${NOMAD_SECRETS_DIR}/api.sock")),
        "NOMAD_ADDR should be the Task API socket, got {addr:?}"
    );
    let addr = match attr(env.body(), "DHV_BINDER_METRICS_ADDR") {
        Some(Expression::String(s)) => s.clone(),
        Some(Expression::TemplateExpr(t)) => t.to_string(),
        other => panic!("DHV_BINDER_METRICS_ADDR should be a string, got {other:?}"),
    };
    assert!(
        addr.starts_with("127.0.0.1:"),
        "metrics beyond loopback: {addr}"
    );
    // Placed before ordinary jobs, updated one node at a time, metrics discoverable.
    let priority = attr(job.body(), "priority").map(|p| p.to_string());
    assert!(
        priority
            .as_deref()
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|p| p > 50),
        "the daemon's priority must be above the default 50, got {priority:?}"
    );
    let update = one(job.body(), "update");
    assert_eq!(
        attr(update.body(), "max_parallel").map(|e| e.to_string()),
        Some("1".to_string())
    );
    let group = one(job.body(), "group");
    let service = one(group.body(), "service");
    assert_eq!(string(service.body(), "provider"), "nomad");
    let port = string(service.body(), "port");
    let network = one(group.body(), "network");
    assert!(
        blocks(network.body(), "port")
            .iter()
            .any(|p| label(p) == port),
        "the service's port {port} is not a port of the group's network"
    );
    assert!(addr.contains(&format!("${{NOMAD_PORT_{port}}}")), "{addr}");
    // Helpers outlive the task: per-volume helper cgroups, each with a memory limit.
    assert_eq!(string(env.body(), "DHV_BINDER_HELPER_CGROUP"), "auto");
    assert!(!string(env.body(), "DHV_BINDER_HELPER_MEMORY_MAX").is_empty());
}

/// The prestart task calls the daemon with its identity through the socket volume, and
/// the main task mounts the deferred volume.
fn check_example(name: &str) {
    let body = read(name);
    let job = check_job(&body);
    let group = one(job.body(), "group");
    let tasks = blocks(group.body(), "task");
    let prestart: Vec<_> = tasks
        .iter()
        .filter(|t| {
            blocks(t.body(), "lifecycle")
                .first()
                .is_some_and(|l| string(l.body(), "hook") == "prestart")
        })
        .collect();
    assert_eq!(prestart.len(), 1, "{name}: one prestart task");
    let p = prestart[0];
    let lc = one(p.body(), "lifecycle");
    assert_eq!(
        attr(lc.body(), "sidecar"),
        Some(&Expression::Bool(false)),
        "prestart must not be a sidecar"
    );
    assert_eq!(
        attr(one(p.body(), "identity").body(), "env"),
        Some(&Expression::Bool(true))
    );
    let vm = one(p.body(), "volume_mount");
    assert_eq!(string(vm.body(), "destination"), "/run/dhv-binder");
    let socket_vol = blocks(group.body(), "volume")
        .into_iter()
        .find(|v| label(v) == string(vm.body(), "volume"))
        .unwrap();
    assert_eq!(string(socket_vol.body(), "source"), "dhv-binder-socket");
    let data = blocks(group.body(), "volume")
        .into_iter()
        .find(|v| string(v.body(), "source") == "shared-data")
        .expect("the deferred volume");
    assert_eq!(string(data.body(), "access_mode"), "single-node-writer");
}

#[test]
fn example_jobs_gate_their_tasks_on_publish() {
    check_example("example.nomad.hcl");
    check_example("example-docker.nomad.hcl");
}

#[test]
fn policy_grants_what_the_daemon_calls() {
    let body = read("dhv-binder-policy.hcl");
    let namespaces = blocks(&body, "namespace");
    let labels: Vec<String> = namespaces.iter().map(|b| label(b)).collect();
    // Only the served namespace ("default"): no "*" block, so nothing at all in a namespace
    // the daemon does not serve (issue 33 finding 6: least privilege; the stream mode's
    // `namespace "*" { read-job }` stays a comment).
    assert_eq!(labels, ["default"]);
    let caps_of = |ns: &Block| match attr(ns.body(), "capabilities") {
        Some(Expression::Array(a)) => a
            .iter()
            .map(|e| match e {
                Expression::String(s) => s.clone(),
                o => panic!("{o:?}"),
            })
            .collect::<Vec<_>>(),
        o => panic!("capabilities: {o:?}"),
    };
    let paths_of = |ns: &Block| -> Vec<String> {
        one(ns.body(), "variables")
            .body()
            .blocks()
            .filter(|b| b.identifier() == "path")
            .map(|b| label(b).to_string())
            .collect()
    };
    // The served namespace: what the daemon calls there.
    assert_eq!(
        caps_of(namespaces[0]),
        [
            "read-job",
            "alloc-lifecycle",
            "host-volume-register",
            "host-volume-read",
            "host-volume-delete"
        ]
    );
    // Only the records, the claims, the snapshot records and the forced-unpublish requests:
    // nothing else under dhv-binder/;
    // in "default" also the node records and the change marker; outside it only the
    // secrets path the agent is told to use (--secrets-path), read only.
    assert_eq!(
        paths_of(namespaces[0]),
        [
            "dhv-binder/volumes/*",
            "dhv-binder/claims/*",
            "dhv-binder/snapshots/*",
            "dhv-binder/unpublish-requests/*",
            "dhv-binder/nodes/*",
            "dhv-binder/records-changed",
            "dhv-binder-secrets/*"
        ]
    );
    let secrets = one(namespaces[0].body(), "variables")
        .body()
        .blocks()
        .find(|b| label(b) == "dhv-binder-secrets/*")
        .unwrap();
    assert_eq!(
        attr(secrets.body(), "capabilities")
            .map(|e| e.to_string().split_whitespace().collect::<String>()),
        Some(r#"["read"]"#.to_string()),
        "the agent reads secrets, never lists or writes them"
    );
    assert_eq!(string(one(&body, "node").body(), "policy"), "read");
    assert_eq!(string(one(&body, "agent").body(), "policy"), "read");
}

/// The operator's policy (issue 37 #14) parses and grants what the CLI calls: the records and
/// snapshots read/list/write/destroy, claims and node records read, the change marker read
/// and write, the forced-unpublish requests read/list/write, host volumes and jobs
/// read, node read; nothing for the daemon's own work (host-volume-register, alloc-lifecycle).
#[test]
fn operator_policy_grants_what_the_cli_calls() {
    let body = read("operator-policy.hcl");
    let namespaces = blocks(&body, "namespace");
    assert_eq!(
        namespaces.iter().map(|b| label(b)).collect::<Vec<_>>(),
        ["default"]
    );
    let caps: Vec<String> = match attr(namespaces[0].body(), "capabilities") {
        Some(Expression::Array(a)) => a
            .iter()
            .map(|e| match e {
                Expression::String(s) => s.clone(),
                o => panic!("{o:?}"),
            })
            .collect(),
        o => panic!("capabilities: {o:?}"),
    };
    assert_eq!(caps, ["read-job", "host-volume-read"]);
    let paths: Vec<(String, String)> = one(namespaces[0].body(), "variables")
        .body()
        .blocks()
        .filter(|b| b.identifier() == "path")
        .map(|b| {
            let c = match attr(b.body(), "capabilities") {
                Some(Expression::Array(a)) => format!("{a:?}"),
                o => panic!("{o:?}"),
            };
            (label(b).to_string(), c)
        })
        .collect();
    let names: Vec<&str> = paths.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        names,
        [
            "dhv-binder/volumes/*",
            "dhv-binder/snapshots/*",
            "dhv-binder/claims/*",
            "dhv-binder/nodes/*",
            "dhv-binder/records-changed",
            "dhv-binder/unpublish-requests/*"
        ]
    );
    for (p, c) in &paths[..2] {
        for cap in ["read", "list", "write", "destroy"] {
            assert!(c.contains(&format!("\"{cap}\"")), "{p} lacks {cap}: {c}");
        }
    }
    for (p, c) in &paths[2..4] {
        assert!(!c.contains("write") && c.contains("\"read\""), "{p}: {c}");
    }
    // The change marker every record write updates (issue 35): read and write, no list.
    let (p, c) = &paths[4];
    assert!(
        c.contains("\"read\"") && c.contains("\"write\"") && !c.contains("list"),
        "{p}: {c}"
    );
    // `volume unpublish -force`: its request written, the node's answer read; no destroy.
    let (p, c) = &paths[5];
    assert!(
        c.contains("\"write\"") && c.contains("\"read\"") && !c.contains("destroy"),
        "{p}: {c}"
    );
    assert_eq!(string(one(&body, "node").body(), "policy"), "read");
}

#[test]
fn sample_volume_spec_is_valid() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("jobspecs/volume.hcl");
    let (spec, _) =
        dhv_binder::volume::parse_spec(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(spec.name, "shared-data");
    assert_eq!(spec.plugin_id, "bind");
}

/// The docker example's prestart task keeps its token off every command line: only the
/// shell's builtin `printf` sees it, and curl reads the header from stdin (`-H @-`); a process
/// listing on the node shows no secret.
#[test]
fn docker_example_keeps_the_token_off_command_lines() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("jobspecs/example-docker.nomad.hcl"),
    )
    .unwrap();
    let uses: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("$NOMAD_TOKEN") && !l.starts_with('#'))
        .collect();
    assert!(!uses.is_empty(), "the prestart task uses its token");
    for l in uses {
        assert!(
            l.starts_with("printf ") && l.ends_with('|'),
            "the token is on a command line: {l}"
        );
    }
    assert!(text.contains("-H @-"), "curl reads the header from stdin");
}

/// Issue 33 finding 7: the systemd unit is hardened. `systemd-analyze security --offline=yes`
/// scores it under 5 (it was 9.6 UNSAFE), and it keeps the agent in the host's mount
/// namespace (no option that makes a namespace for it: the agent refuses to start in one).
#[test]
fn the_systemd_unit_is_hardened_and_stays_in_the_hosts_mount_namespace() {
    let unit = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("packaging/dhv-binder.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    for option in [
        "ProtectSystem=",
        "ProtectHome=",
        "PrivateTmp=",
        "PrivateDevices=",
        "PrivateMounts=",
        "ProtectKernelTunables=",
        "ProtectKernelModules=",
        "ProtectKernelLogs=",
        "ProtectControlGroups=",
        "ProtectProc=",
        "ProcSubset=",
        "ReadWritePaths=",
        "ReadOnlyPaths=",
        "InaccessiblePaths=",
        "TemporaryFileSystem=",
        "BindPaths=",
        "RootDirectory=",
        "MountFlags=",
    ] {
        assert!(
            !text.lines().any(|l| l.trim_start().starts_with(option)),
            "{option} gives the agent a mount namespace of its own: its mounts would be invisible to Nomad and to tasks"
        );
    }
    assert!(
        text.contains("\nKillMode=process\n"),
        "published FUSE helpers must outlive a restart"
    );
    assert!(
        text.contains("CAP_SYS_ADMIN"),
        "the capability bounding set must keep CAP_SYS_ADMIN (mounts)"
    );
    // systemd-analyze names the unit after its file: score a copy named as installed.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("dhv-binder.service");
    std::fs::write(&copy, &text).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&copy)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run systemd-analyze ({e}): install the Debian package systemd (scripts/install-deps does)")
        });
    let report = String::from_utf8_lossy(&out.stdout);
    let score: f64 = report
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for dhv-binder.service: "))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no overall exposure level in systemd-analyze's output: {report}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    eprintln!("systemd-analyze security --offline=yes dhv-binder.service: {score}");
    assert!(score < 5.0, "exposure {score} is not under 5:\n{report}");
}
