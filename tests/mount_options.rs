//! End to end, mount options (issue 49, "Done means"): a volume whose spec asks
//! `mount_flags = ["noexec"]` is published `noexec,nosuid,nodev`; one without is published
//! `nosuid,nodev`; a setuid-root binary left in either volume (written by whoever writes the
//! storage: here the test, as root, into the export) does not run setuid for a task there,
//! while the same file does when run from the allocation's shared dir (the control, on a
//! filesystem without nosuid), and nothing on the `noexec` volume runs at all.

mod support;

use support::cluster::Cluster;

/// The options of the mount at `target` on the host's table (`findmnt`).
fn options(target: &std::path::Path) -> Vec<String> {
    let out = std::process::Command::new("findmnt")
        .args(["-rn", "-o", "OPTIONS", "--mountpoint"])
        .arg(target)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .split(',')
        .map(str::to_string)
        .collect()
}

/// A job with the prestart gate and one task (Nomad's `exec` runs it as nobody) that mounts
/// both volumes (`/hard`: noexec, `/plain`: defaults) and prints what the setuid-root `id`
/// in each, and the control (`/alloc/control-id`, once the test put it there), say its
/// effective user is.
const JOB: &str = r#"job "flags" {
  type        = "service"
  datacenters = ["*"]
  group "app" {
    volume "hard" {
      type            = "host"
      source          = "hard"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }
    volume "plain" {
      type            = "host"
      source          = "plain"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }
    volume "dhv-binder" {
      type      = "host"
      source    = "dhv-binder-socket"
      read_only = true
    }
    task "publish-volumes" {
      lifecycle {
        hook    = "prestart"
        sidecar = false
      }
      driver = "exec"
      config {
        command = "/usr/local/bin/dhv-binder"
        args    = ["prestart", "--timeout", "2m"]
      }
      identity {
        env = true
      }
      volume_mount {
        volume      = "dhv-binder"
        destination = "/run/dhv-binder"
        read_only   = true
      }
    }
    task "app" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          i=0; until [ -e /alloc/control-id ] || [ $i -ge 600 ]; do sleep 0.1; i=$((i+1)); done
          for f in /hard/id /plain/id /alloc/control-id; do
            echo "$f euid=$($f -u 2>&1)"
          done
          echo DONE
          sleep 600
        EOT
        ]
      }
      volume_mount {
        volume      = "hard"
        destination = "/hard"
      }
      volume_mount {
        volume      = "plain"
        destination = "/plain"
      }
      kill_timeout = "1s"
    }
  }
}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noexec_volume_is_published_noexec_nosuid_nodev_and_a_plain_one_nosuid_nodev_and_setuid_never_runs(
) {
    let c = Cluster::start(1).await;
    let export = c.export.display().to_string();
    for (name, extra) in [
        ("hard", "mount_options {\n  mount_flags = [\"noexec\"]\n}\n"),
        ("plain", ""),
    ] {
        let out = c.create_volume_with(
            name,
            "single-node-writer",
            "bind",
            &[("export", &export)],
            &[],
            extra,
        );
        assert!(out.contains("is ready"), "{out}");
    }
    // A setuid-root `id` in each volume's storage, and the control beside the export.
    let setuid = |path: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::copy("/usr/bin/id", path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o4755)).unwrap();
    };
    let records = c
        .get("/v1/vars?prefix=dhv-binder/volumes/&namespace=default")
        .await;
    for v in records.as_array().unwrap() {
        let path = v["Path"].as_str().unwrap();
        let rec = c.get(&format!("/v1/var/{path}?namespace=default")).await;
        let id = rec["Items"]["id"].as_str().unwrap();
        setuid(&c.export.join("default").join(id).join("id"));
    }
    let spec = c.sb.join("flags.nomad.hcl");
    std::fs::write(&spec, JOB).unwrap();
    let job = c.run_job(&spec).await;
    let alloc = c.running_alloc(&job, "app", 90, "the task running").await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    // The control: the same file in the allocation's shared dir (bound at /alloc).
    setuid(
        &c.sb
            .join(&format!("sim/node-1/alloc/{alloc_id}/alloc/control-id")),
    );
    let log = c.sb.join(&format!(
        "sim/node-1/alloc/{alloc_id}/alloc/logs/app.stdout.0"
    ));
    let out = c
        .wait_for(60, "the task's report", || async {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|t| t.contains("DONE"))
        })
        .await;
    // On the host's mount table.
    let hard = options(&c.target(0, "hard"));
    let plain = options(&c.target(0, "plain"));
    for o in ["noexec", "nosuid", "nodev"] {
        assert!(
            hard.contains(&o.to_string()),
            "{o} missing on hard: {hard:?}"
        );
    }
    for o in ["nosuid", "nodev"] {
        assert!(
            plain.contains(&o.to_string()),
            "{o} missing on plain: {plain:?}"
        );
    }
    assert!(!plain.contains(&"noexec".to_string()), "{plain:?}");
    // In the task (nobody): setuid root works from the control, not from the volumes.
    assert!(
        out.contains("/alloc/control-id euid=0"),
        "the control did not run setuid: {out}"
    );
    assert!(
        out.contains("/plain/id euid=65534"),
        "setuid ran on the volume: {out}"
    );
    let hard = out.lines().find(|l| l.starts_with("/hard/id ")).unwrap();
    assert!(
        hard.contains("Permission denied"),
        "a binary ran on the noexec volume: {out}"
    );
    c.stop_job(&job, false).await;
}
