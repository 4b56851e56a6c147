//! `dhv-binder helper run --cgroup <dir> -- <command> [args…]`: starts a plugin's long-lived
//! helper (a FUSE server) in the volume's helper cgroup (`DHV_HELPER_CGROUP`), outside the
//! cgroup of the agent that called the plugin, so that it outlives the agent's task
//! (docs/plugin-protocol.md, "Helpers"). The process moves itself into the cgroup, then
//! becomes `<command>` (exec): same PID, environment, descriptors and session.

use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use std::ffi::OsString;
use std::path::PathBuf;

/// `dhv-binder helper …`.
#[derive(Debug, clap::Subcommand)]
pub enum HelperCommand {
    /// Run a command in a cgroup: it moves itself into `--cgroup`, then execs the command.
    Run {
        /// The cgroup (a directory on the cgroup v2 filesystem), `$DHV_HELPER_CGROUP` in a
        /// plugin's `publish`.
        #[arg(long)]
        cgroup: PathBuf,
        /// The command and its arguments (after `--`).
        #[arg(required = true, last = true)]
        command: Vec<OsString>,
    },
}

/// Runs `helper run`: returns only on failure (exec replaces this process).
pub fn helper_cmd(cmd: HelperCommand) -> Result<(), Failure> {
    use std::os::unix::process::CommandExt;
    let HelperCommand::Run { cgroup, command } = cmd;
    let procs = cgroup.join("cgroup.procs");
    std::fs::write(&procs, "0").map_err(|e| {
        Failure::new(
            EXIT_FAILED,
            format!(
                "cannot enter the cgroup {} (writing {}: {e}); it must be a directory on the cgroup v2 filesystem and this must run as root",
                cgroup.display(),
                procs.display()
            ),
        )
    })?;
    let (program, args) = command
        .split_first()
        .ok_or_else(|| Failure::new(EXIT_CONFIG, "no command given after --"))?;
    let e = std::process::Command::new(program).args(args).exec();
    Err(Failure::new(
        EXIT_FAILED,
        format!("cannot run {}: {e}", PathBuf::from(program).display()),
    ))
}
