//! The command line: `agent`, `prestart`, `status`, `volume create|register|list|status|delete|deregister`,
//! `volume snapshot create|list|delete` ([`storage`]), `volume claim release` ([`claim`]),
//! `plugin check|status`, `node status [node]`, `alloc status` ([`alloc`]), `helper run|bind-mount|remove|mkdir|rename|exec|copy|credential-proxy` ([`helper`], for plugins); one file per command group, [`output`] for the
//! readable (Nomad-style) and JSON forms every read command prints, [`records`] for the
//! volume records both `volume` and the storage commands read.
//!
//! Exit codes: 0 success; 1 the operation failed or was refused; 2 usage error (clap);
//! 64 bad configuration or input; 69 Nomad or the local agent could not be reached;
//! 75 timed out (trying again may help).

/// Prints a line on stdout; a closed pipe (`dhv-binder volume list | head`) ends the
/// process quietly instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        if writeln!(out, $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

pub mod alloc;
pub mod claim;
pub mod helper;
pub mod node;
pub mod output;
pub mod plugin;
pub mod prestart;
pub mod records;
pub mod status;
pub mod storage;
pub mod unused;
pub mod update;
pub mod volume;

use crate::config::{AgentConfig, NomadConfig};
use crate::nomad::NomadError;
use clap::{Parser, Subcommand};

pub use plugin::{plugin_cmd, PluginCommand};
pub use prestart::{prestart, PrestartArgs};
pub use status::{status, StatusArgs};
pub use volume::{volume_cmd, VolumeCommand};

/// The agent's socket as a prestart task sees it: the job mounts the socket's host volume
/// at `/run/dhv-binder` inside the task.
#[derive(Debug, Clone, clap::Args)]
pub struct SocketArg {
    /// The daemon's socket, as mounted into the task.
    #[arg(
        long = "socket",
        env = "DHV_BINDER_SOCKET",
        default_value = "/run/dhv-binder/api.sock"
    )]
    pub path: std::path::PathBuf,
}

/// The agent's socket on the node itself (for `status`, run on the host): the static host
/// volume directory that survives a reboot.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeSocketArg {
    /// The daemon's socket on this node.
    #[arg(
        long = "socket",
        env = "DHV_BINDER_SOCKET",
        default_value = "/var/lib/dhv-binder/socket/api.sock"
    )]
    pub path: std::path::PathBuf,
}

/// Exit code: the operation failed or was refused.
pub const EXIT_FAILED: i32 = 1;
/// Exit code: bad configuration or input (EX_USAGE).
pub const EXIT_CONFIG: i32 = 64;
/// Exit code: a service could not be reached (EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: i32 = 69;
/// Exit code: timed out (EX_TEMPFAIL).
pub const EXIT_TIMEOUT: i32 = 75;

/// dhv-binder: deferred binding for Nomad dynamic host volumes.
#[derive(Debug, Parser)]
#[command(name = "dhv-binder", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub nomad: NomadConfig,
    #[command(subcommand)]
    pub command: Command,
    /// True when NOMAD_SKIP_VERIFY came from the environment rather than
    /// `--tls-skip-verify` on the command line (`dhv-binder agent` sets it aside:
    /// [`crate::config::NomadConfig::for_agent`]).
    #[arg(skip)]
    pub skip_verify_from_env: bool,
}

impl Cli {
    /// Parses the process arguments, accepting the Nomad CLI's single-dash spellings of
    /// every long flag (`-namespace`, `-detach`, `-json`, `-verbose`...) besides clap's
    /// `--namespace`: see [`normalize_args`].
    pub fn parse_args() -> Self {
        use clap::{CommandFactory, FromArgMatches};
        let args = normalize_args(std::env::args_os());
        let matches = Self::command()
            .try_get_matches_from(&args)
            .unwrap_or_else(|e| usage_as_in_help(e, &args).exit());
        let mut cli = Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        cli.skip_verify_from_env =
            matches.value_source("skip_verify") == Some(clap::parser::ValueSource::EnvVariable);
        cli
    }
}

/// `e`, a parse error of `args`, with the usage line its command's help shows. clap's error
/// usage names every flag given a value, the environment's included, as if the command
/// needed it (`volume update --signing-key <SIGNING_KEY> --address <ADDRESS> …` wherever
/// DHV_BINDER_SIGNING_KEY and NOMAD_ADDR are set): the same arguments parsed with no
/// environment fallback give the same error without them. An error the environment alone
/// caused (a bad NOMAD_SKIP_VERIFY) is kept as it is.
fn usage_as_in_help(e: clap::Error, args: &[std::ffi::OsString]) -> clap::Error {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        return e;
    }
    fn without_env(c: clap::Command) -> clap::Command {
        c.mut_args(|a| a.env(None)).mut_subcommands(without_env)
    }
    match without_env(<Cli as clap::CommandFactory>::command()).try_get_matches_from(args) {
        Err(plain) if plain.kind() == e.kind() => plain,
        _ => e,
    }
}

/// Every long flag name of the command line, over all subcommands.
fn long_flags() -> std::collections::BTreeSet<String> {
    fn walk(c: &clap::Command, out: &mut std::collections::BTreeSet<String>) {
        for a in c.get_arguments() {
            if let Some(l) = a.get_long() {
                out.insert(l.to_string());
            }
            for l in a.get_all_aliases().unwrap_or_default() {
                out.insert(l.to_string());
            }
        }
        for sc in c.get_subcommands() {
            walk(sc, out);
        }
    }
    let mut out = std::collections::BTreeSet::new();
    walk(&<Cli as clap::CommandFactory>::command(), &mut out);
    out.insert("help".into());
    out.insert("version".into());
    out
}

/// Rewrites the Nomad CLI's single-dash long flags to clap's spelling: `-namespace=prod`
/// becomes `--namespace=prod`, `-detach` `--detach`, for every long flag the command line
/// knows (Nomad's CLI spells them with one dash; both work). One-letter flags (`-t`), `-`
/// (standard input) and anything after `--` are left alone, as is a single-dash word that
/// names no flag (clap then refuses it).
pub fn normalize_args<I: IntoIterator<Item = std::ffi::OsString>>(
    args: I,
) -> Vec<std::ffi::OsString> {
    let longs = long_flags();
    let mut out = Vec::new();
    let mut rest = false;
    for a in args {
        if !rest && a == "--" {
            rest = true;
        } else if !rest {
            if let Some(word) = a.to_str().and_then(|s| s.strip_prefix('-')) {
                let name = word.split('=').next().unwrap_or_default();
                if !word.starts_with('-') && name.len() > 1 && longs.contains(name) {
                    out.push(format!("-{}", a.to_string_lossy()).into());
                    continue;
                }
            }
        }
        out.push(a);
    }
    out
}

// Parsed once per process: the agent variant's size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the per-node daemon (as a Nomad system job on every client node).
    Agent(AgentConfig),
    /// What a job's prestart task runs: waits until this allocation's deferred volumes are published.
    Prestart(PrestartArgs),
    /// Show the local agent's state (as root on the node).
    Status(StatusArgs),
    /// Create, register, list, inspect, delete and deregister deferred volumes; snapshot
    /// them; make an operator signing key (keygen).
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Volume plugins: the conformance kit, and which nodes have which plugin.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// The nodes running dhv-binder, from the records each agent publishes.
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// One allocation: why its prestart waits or failed, per deferred volume.
    #[command(subcommand)]
    Alloc(alloc::AllocCommand),
    /// What plugins call: start a long-lived helper in the volume's helper cgroup (`helper
    /// run`), and mount, remove, make and open paths by handle beneath the storage roots.
    #[command(subcommand, hide = true)]
    Helper(helper::HelperCommand),
    /// Print a shell completion script (e.g. `dhv-binder completion bash >
    /// /etc/bash_completion.d/dhv-binder`).
    Completion {
        /// The shell: bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the manual pages (one per command, `dhv-binder.1`, `dhv-binder-volume.1`, …)
    /// into a directory.
    #[command(hide = true)]
    Manpages {
        /// Where to write them; created if missing.
        dir: std::path::PathBuf,
    },
}

/// Writes the completion script for `shell` to `out`, from the command line's definition.
pub fn completion(shell: clap_complete::Shell, out: &mut dyn std::io::Write) {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut cmd, "dhv-binder", out);
}

/// Writes a manual page per command into `dir` (created if missing), from the command
/// line's definition.
pub fn manpages(dir: &std::path::Path) -> Result<(), Failure> {
    let cannot = |e: std::io::Error| {
        Failure::new(
            EXIT_FAILED,
            format!("cannot write manual pages to {}: {e}", dir.display()),
        )
    };
    std::fs::create_dir_all(dir).map_err(cannot)?;
    clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), dir).map_err(cannot)
}

/// Runs any command but `agent` (which `main` runs with its tracing and signals).
pub async fn run(nomad: &NomadConfig, command: Command) -> Result<(), Failure> {
    match command {
        Command::Agent(_) => Err(Failure::new(
            EXIT_FAILED,
            "the agent is started by main, not by cli::run",
        )),
        Command::Prestart(args) => prestart(args, nomad.token.clone()).await,
        Command::Status(args) => status(args).await,
        Command::Volume(cmd) => volume_cmd(nomad, cmd).await,
        Command::Plugin(cmd) => plugin_cmd(nomad, cmd).await,
        Command::Node(cmd) => node::node_cmd(nomad, cmd).await,
        Command::Alloc(cmd) => alloc::alloc_cmd(nomad, cmd).await,
        Command::Helper(cmd) => helper::helper_cmd(cmd).await,
        Command::Completion { shell } => {
            let mut out = Vec::new();
            completion(shell, &mut out);
            output::print_raw(&String::from_utf8_lossy(&out));
            Ok(())
        }
        Command::Manpages { dir } => manpages(&dir),
    }
}

/// A CLI failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    pub(crate) fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<NomadError> for Failure {
    fn from(e: NomadError) -> Self {
        let code = match &e {
            NomadError::Unreachable { .. }
            | NomadError::NoLeader { .. }
            | NomadError::TimedOut { .. } => EXIT_UNAVAILABLE,
            NomadError::Config(_) => EXIT_CONFIG,
            _ => EXIT_FAILED,
        };
        Failure::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 37 #15: every positional argument of every command is shown in `--help` with a
    /// value name and a line of help (the `Arguments:` section).
    #[test]
    fn every_positional_argument_has_a_name_and_help_in_help() {
        fn walk(c: &mut clap::Command, path: &str, missing: &mut Vec<String>, seen: &mut usize) {
            let help = c.render_help().to_string();
            for a in c.get_positionals() {
                *seen += 1;
                let name = a
                    .get_value_names()
                    .and_then(|v| v.first().map(|n| n.to_string()))
                    .unwrap_or_default();
                let text = a.get_help().map(|h| h.to_string()).unwrap_or_default();
                // Its line in the Arguments section: `  <NAME>  help` or `  [NAME]  help`.
                let shown = help.lines().any(|l| {
                    let l = l.trim_start();
                    [format!("<{name}>"), format!("[{name}]")].iter().any(|p| {
                        l.strip_prefix(p.as_str()).is_some_and(|rest| {
                            let rest = rest.trim_start_matches("...").trim();
                            !rest.is_empty()
                        })
                    })
                });
                if name.is_empty() || text.trim().is_empty() || !shown {
                    missing.push(format!("{path} {}", a.get_id()));
                }
            }
            for sc in c.get_subcommands_mut() {
                let p = format!("{path} {}", sc.get_name());
                walk(sc, &p, missing, seen);
            }
        }
        let mut cmd = <Cli as clap::CommandFactory>::command();
        cmd.build();
        let (mut missing, mut seen) = (Vec::new(), 0);
        walk(&mut cmd, "dhv-binder", &mut missing, &mut seen);
        assert!(seen >= 12, "only {seen} positional arguments found");
        assert!(
            missing.is_empty(),
            "positional arguments without a value name or help in --help: {missing:?}"
        );
    }

    #[test]
    fn nomads_single_dash_flags_are_accepted_everywhere_and_double_dashes_still_work() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(normalize_args(args.iter().map(std::ffi::OsString::from)))
        };
        let cli = parse(&[
            "dhv-binder",
            "-namespace=prod",
            "volume",
            "delete",
            "-detach",
            "-address",
            "http://127.0.0.1:4646",
            "data",
        ])
        .unwrap();
        assert_eq!(cli.nomad.namespace, "prod");
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::Delete { ref wait, .. }) if wait.detach
        ));
        let cli = parse(&[
            "dhv-binder",
            "volume",
            "list",
            "--namespace",
            "ops",
            "-verbose",
        ])
        .unwrap();
        assert_eq!(cli.nomad.namespace, "ops");
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::List { out, .. }) if out.verbose
        ));
        // `-t` stays a short flag; `-` is standard input; a word that names no flag is refused.
        let cli = parse(&["dhv-binder", "volume", "list", "-t", "{{.ID}}"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::List { out, .. }) if out.template.as_deref() == Some("{{.ID}}")
        ));
        assert!(parse(&["dhv-binder", "volume", "create", "-"]).is_ok());
        assert!(parse(&["dhv-binder", "volume", "list", "-nosuchflag"]).is_err());
    }

    /// Issue 37 #9: completions and manual pages come from the command line's definition.
    #[test]
    fn completions_and_manual_pages_are_generated_from_the_definition() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let mut out = Vec::new();
            completion(shell, &mut out);
            let text = String::from_utf8(out).unwrap();
            assert!(text.contains("dhv-binder"), "{shell}: {text}");
            assert!(
                text.contains("snapshot"),
                "{shell}: no volume snapshot in it"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        manpages(dir.path()).unwrap();
        let page = std::fs::read_to_string(dir.path().join("dhv-binder-volume-create.1")).unwrap();
        assert!(page.contains(".TH"), "{page}");
        assert!(page.contains("detach"), "{page}");
        assert!(dir.path().join("dhv-binder.1").exists());
    }

    #[test]
    fn single_dash_json_is_accepted_before_the_separator_only() {
        let args =
            ["dhv-binder", "volume", "list", "-json", "--", "-json"].map(std::ffi::OsString::from);
        let out = normalize_args(args);
        assert_eq!(out[3], "--json");
        assert_eq!(out[5], "-json");
        let cli = Cli::try_parse_from(normalize_args(
            ["dhv-binder", "volume", "list", "-json"].map(std::ffi::OsString::from),
        ))
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::List { out, .. }) if out.json
        ));
    }
}
