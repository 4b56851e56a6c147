//! Jobs the end-to-end tests submit, built from the repository's `jobspecs/example.nomad.hcl`
//! so that they keep its prestart gate (the `publish-volumes` task and the socket volume).
#![allow(dead_code)]

use super::cluster::repo;
use std::path::{Path, PathBuf};

fn example() -> String {
    std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap()
}

/// A service job `name` in `dir/<name>.nomad.hcl`: group `app` with `group_extra` lines (a
/// constraint, a restart block), the `single-node-writer` volume `volume` at `/data`, the
/// example's prestart task, and a main exec task running `/bin/sh -c <script>`
/// (`kill_timeout` 1 s). `script` is HCL string content: quotes escaped as `\"`.
pub fn exec_writer_job(
    dir: &Path,
    name: &str,
    volume: &str,
    group_extra: &str,
    script: &str,
) -> PathBuf {
    let example = example();
    let start = example.find("    task \"publish-volumes\"").unwrap();
    let end = example.find("    task \"app\"").unwrap();
    let prestart = &example[start..end];
    let hcl = format!(
        r#"job "{name}" {{
  type        = "service"
  datacenters = ["*"]
  group "app" {{
{group_extra}
    volume "data" {{
      type            = "host"
      source          = "{volume}"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}
    volume "dhv-binder" {{
      type      = "host"
      source    = "dhv-binder-socket"
      read_only = true
    }}
{prestart}
    task "app" {{
      driver = "exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "{script}"]
      }}
      volume_mount {{
        volume      = "data"
        destination = "/data"
      }}
      kill_timeout = "1s"
    }}
  }}
}}
"#
    );
    let path = dir.join(format!("{name}.nomad.hcl"));
    std::fs::write(&path, hcl).unwrap();
    path
}

/// The example job as it is, but named `name`, using volume `volume`, written to
/// `dir/<file>`, with a main task that appends `line <n> <unix ns>` to `/data/log` every
/// 50 ms, opening the file each time (each write goes through the mount), and reports every
/// failed write on stderr with its time. Read the log back with [`log_lines`].
pub fn line_writer_example(dir: &Path, file: &str, name: &str, volume: &str) -> PathBuf {
    let example = example();
    let start = example.find("<<-EOT").expect("the example's heredoc") + "<<-EOT".len();
    let end = start + example[start..].find("EOT").unwrap();
    let body = r#"
          i=0
          while true; do
            i=$((i + 1))
            now=$(date +%s%N)
            echo "line $i $now" >> /data/log || echo "write $i failed at $now" >&2
            sleep 0.05
          done
        "#;
    let job = format!("{}{}{}", &example[..start], body, &example[end..]);
    for from in [
        "job \"shared-data-demo\"",
        "source          = \"shared-data\"",
    ] {
        assert!(job.contains(from), "the example job no longer has {from}");
    }
    let job = job
        .replace("job \"shared-data-demo\"", &format!("job \"{name}\""))
        .replace(
            "source          = \"shared-data\"",
            &format!("source          = \"{volume}\""),
        );
    let path = dir.join(file);
    std::fs::write(&path, job).unwrap();
    path
}

/// The numbered lines of a [`line_writer_example`] log, in order, with their times (ns).
pub fn log_lines(text: &str) -> Vec<(u64, u128)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "line").then_some(())?;
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect()
}
