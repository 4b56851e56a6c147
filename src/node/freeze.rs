//! Thawing a filesystem that a storage operation left frozen: the agent started a
//! `snapshot_create` that may freeze the volume's mount (`fsfreeze -f`, the ext4 reference
//! plugin), so whenever such a call ends, however it ended (success, failure, timeout, a
//! killed plugin), the agent thaws the mount itself with util-linux `fsfreeze -u`. A
//! filesystem that was not frozen refuses the thaw (EINVAL), which tells the two apart.

use std::path::Path;
use std::time::Duration;

/// Where util-linux installs `fsfreeze`.
const FSFREEZE: [&str; 3] = ["/usr/sbin/fsfreeze", "/sbin/fsfreeze", "/usr/bin/fsfreeze"];

/// The longest a thaw may take (it never waits on the frozen filesystem's writers).
const THAW_TIMEOUT: Duration = Duration::from_secs(10);

/// What a thaw found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Thawed {
    /// The filesystem was frozen, and is thawed now.
    WasFrozen,
    /// It was not frozen (the thaw was refused as having nothing to do).
    NotFrozen,
    /// The thaw could not be run or failed otherwise (the message says why).
    Failed(String),
}

/// Thaws the filesystem mounted at `target` (`fsfreeze -u <target>`).
pub async fn thaw(target: &Path) -> Thawed {
    let Some(bin) = FSFREEZE.iter().find(|p| Path::new(p).is_file()) else {
        return Thawed::Failed(
            "fsfreeze (util-linux) is not installed: cannot thaw a volume a snapshot may have left frozen".into(),
        );
    };
    let run = tokio::process::Command::new(bin)
        .arg("-u")
        .arg(target)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(THAW_TIMEOUT, run).await {
        Err(_) => Thawed::Failed(format!(
            "fsfreeze -u did not answer within {THAW_TIMEOUT:?}"
        )),
        Ok(Err(e)) => Thawed::Failed(format!("cannot run {bin}: {e}")),
        Ok(Ok(o)) if o.status.success() => Thawed::WasFrozen,
        Ok(Ok(o)) => {
            let err = String::from_utf8_lossy(&o.stderr);
            if err.contains("Invalid argument") {
                Thawed::NotFrozen
            } else {
                Thawed::Failed(crate::escape::escape_control(err.trim()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory that is no frozen filesystem: the thaw has nothing to do.
    #[tokio::test]
    async fn a_filesystem_not_frozen_is_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(thaw(dir.path()).await, Thawed::NotFrozen);
    }
}
