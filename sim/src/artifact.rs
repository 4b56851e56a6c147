//! The task's `artifact` blocks, fetched into the task directory before the task starts.
//!
//! Models Nomad's artifact hook (`client/allocrunner/taskrunner/artifact_hook.go`
//! `artifactHook.Prestart`) over go-getter (`hashicorp/go-getter`): the subset the
//! dhv-binder system job uses.
//! - source: go-getter's http(s) getter (`get_http.go` `HttpGetter`); the URL is
//!   interpolated with the task's environment first;
//! - `options { checksum = "sha256:<hex>" }` (`checksum.go` `newChecksumFromValue`,
//!   `Checksum`): the downloaded file is checked before it is unpacked; a mismatch is
//!   go-getter's `ChecksumError` (`Checksums did not match for <file>.\nExpected: <hex>\nGot:
//!   <hex>\n*sha256.digest`);
//! - unpacking (`decompress.go`, mode `any`): a source ending `.tar.gz` or `.tgz` is
//!   unpacked into `destination`; any other file is written there under its URL's last
//!   path element;
//! - `destination` relative to the task directory, `local/` by default
//!   (`api/tasks.go` `TaskArtifact.Canonicalize`).
//!
//! A failure is the hook's `failed to download artifact "<source>": <error>`, in a
//! `Failed Artifact Download` task event with `DownloadError`; it is recoverable, so the
//! task restarts under its restart policy (`structs.NewRecoverableError(.., true)`).

use serde_json::Value;
use std::path::Path;

/// One `artifact` block as the job carries it (`Task.Artifacts[]`, Nomad's
/// `structs.TaskArtifact`).
#[derive(Debug, Clone, PartialEq)]
pub struct Artifact {
    /// `GetterSource`: the URL.
    pub source: String,
    /// `GetterOptions["checksum"]`: `<type>:<hex>`, if any.
    pub checksum: Option<String>,
    /// `RelativeDest`: under the task directory.
    pub destination: String,
}

impl Artifact {
    /// The artifacts of a task's `Artifacts` JSON (null or an array of TaskArtifact).
    pub fn list(v: &Value) -> Vec<Artifact> {
        v.as_array()
            .into_iter()
            .flatten()
            .map(|a| Artifact {
                source: a["GetterSource"].as_str().unwrap_or_default().to_string(),
                checksum: a["GetterOptions"]["checksum"].as_str().map(str::to_string),
                destination: a["RelativeDest"]
                    .as_str()
                    .filter(|d| !d.is_empty())
                    .unwrap_or("local/")
                    .to_string(),
            })
            .collect()
    }

    /// The job JSON of this artifact (`structs.TaskArtifact`).
    pub fn to_json(&self) -> Value {
        let mut options = serde_json::Map::new();
        if let Some(c) = &self.checksum {
            options.insert("checksum".into(), Value::String(c.clone()));
        }
        serde_json::json!({
            "GetterSource": self.source,
            "GetterOptions": options,
            "GetterHeaders": null,
            "GetterMode": "any",
            "RelativeDest": self.destination,
        })
    }
}

/// Fetches `a` (its source already interpolated) into `task_dir`. The error is the task
/// event's message (`failed to download artifact ...`).
pub async fn fetch(a: &Artifact, task_dir: &Path) -> Result<(), String> {
    let fail = |e: String| format!("failed to download artifact {:?}: {e}", a.source);
    let resp = reqwest::get(&a.source)
        .await
        .map_err(|e| fail(format!("error downloading '{}': {e}", a.source)))?;
    if !resp.status().is_success() {
        return Err(fail(format!(
            "bad response code: {}",
            resp.status().as_u16()
        )));
    }
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| fail(format!("error downloading '{}': {e}", a.source)))?;
    let path = a.source.split(['?', '#']).next().unwrap_or_default();
    let file = path.rsplit('/').next().unwrap_or("artifact").to_string();
    let dest = task_dir.join(a.destination.trim_start_matches('/'));
    std::fs::create_dir_all(&dest).map_err(|e| fail(e.to_string()))?;
    // Downloaded beside the destination first, checked, then unpacked or moved.
    let tmp = task_dir.join(format!(".artifact-{file}"));
    std::fs::write(&tmp, &bytes).map_err(|e| fail(e.to_string()))?;
    let result = check_and_place(a, &tmp, &file, &dest).await;
    let _ = std::fs::remove_file(&tmp);
    result.map_err(fail)
}

async fn check_and_place(a: &Artifact, tmp: &Path, file: &str, dest: &Path) -> Result<(), String> {
    if let Some(c) = &a.checksum {
        let (kind, want) = c
            .split_once(':')
            .ok_or_else(|| format!("invalid checksum: {c}"))?;
        if kind != "sha256" {
            return Err(format!("unsupported checksum type: {kind}"));
        }
        let out = tokio::process::Command::new("sha256sum")
            .arg(tmp)
            .output()
            .await
            .map_err(|e| format!("sha256sum: {e}"))?;
        let got = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        if !out.status.success() || got.len() != 64 {
            return Err(format!(
                "sha256sum failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if !got.eq_ignore_ascii_case(want) {
            return Err(format!(
                "Checksums did not match for {}.\nExpected: {}\nGot: {}\n*sha256.digest",
                tmp.display(),
                want.to_ascii_lowercase(),
                got
            ));
        }
    }
    if file.ends_with(".tar.gz") || file.ends_with(".tgz") {
        let out = tokio::process::Command::new("tar")
            .arg("-xzf")
            .arg(tmp)
            .arg("-C")
            .arg(dest)
            .output()
            .await
            .map_err(|e| format!("tar: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "error decompressing: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    } else {
        std::fs::copy(tmp, dest.join(file)).map_err(|e| e.to_string())?;
        Ok(())
    }
}
