//! `dhv-binder helper …`: what plugins call.
//!
//! - `helper run --cgroup <dir> -- <command> [args…]`: starts a plugin's long-lived helper
//!   (a FUSE server) in the volume's helper cgroup (`DHV_HELPER_CGROUP`), outside the cgroup
//!   of the agent that called the plugin, so that it outlives the agent's task
//!   (docs/plugin-protocol.md, "Helpers"). The process moves itself into the cgroup, then
//!   becomes `<command>` (exec): same PID, environment, descriptors and session.
//! - `helper bind-mount`, `remove`, `mkdir`, `rename`, `exec`: the path-sensitive steps of a
//!   plugin done by handle beneath the node's storage roots ([`crate::node::beneath`];
//!   docs/plugin-protocol.md, "Paths are used by handle"), so that nothing can swap a
//!   directory for a symlink between a check and a use.
//! - `helper credential-proxy`: a volume's credential proxy on loopback
//!   ([`crate::storage::credential_proxy`]), so that a FUSE remote's credentials change
//!   without an unmount (the webdav plugin's `refresh`).
//! - `helper copy`: a directory tree copied by handle ([`crate::node::copy`]), the copy of a
//!   snapshot, clone or create-from-snapshot, which `cp -a` did by name.

use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::node::beneath::{self, Beneath, BeneathError, DirAttrs, Roots};
use crate::volume::mount_options::MountFlags;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

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
    /// Bind-mount a directory beneath a storage root onto a target, from its handle
    /// (`/proc/self/fd/N`): no symlink beneath the root is followed.
    BindMount {
        #[command(flatten)]
        roots: RootArgs,
        /// Make the mount read-only (before any task can see it).
        #[arg(long)]
        read_only: bool,
        /// The mount's flags, `,`-separated as `DHV_MOUNT_FLAGS` gives them (`nosuid`,
        /// `nodev`, `noexec`, `suid`, `dev`, atime modes); default `nosuid,nodev`.
        #[arg(long, default_value = "nosuid,nodev")]
        flags: String,
        /// The directory to mount (absolute, beneath a root).
        source: PathBuf,
        /// Where to mount it (a directory, e.g. `$DHV_TARGET_PATH`).
        target: PathBuf,
    },
    /// Remove a file or a directory tree beneath a storage root without following any
    /// symlink and without crossing a mount; a missing path is success.
    Remove {
        #[command(flatten)]
        roots: RootArgs,
        /// What to remove (absolute, beneath a root, not a root itself).
        path: PathBuf,
    },
    /// Make a directory beneath a storage root, following no symlink.
    Mkdir {
        #[command(flatten)]
        roots: RootArgs,
        /// Make missing parents too; an existing directory is success.
        #[arg(long, short = 'p')]
        parents: bool,
        /// Owner of the directory, `UID:GID` (numbers), set by handle.
        #[arg(long)]
        owner: Option<String>,
        /// Mode of the directory, octal (`0755`), set by handle.
        #[arg(long)]
        mode: Option<String>,
        /// The directory (absolute, beneath a root).
        path: PathBuf,
    },
    /// Rename a file or directory beneath a storage root (both paths beneath the same root).
    Rename {
        #[command(flatten)]
        roots: RootArgs,
        /// What to rename.
        from: PathBuf,
        /// Its new path.
        to: PathBuf,
    },
    /// Copy everything in a directory into an empty directory, both beneath storage roots,
    /// by handle: every entry opened relative to its directory's handle, no symlink followed
    /// (copied as a symlink), owners, modes, times and hard links kept as `cp -a` keeps them;
    /// device nodes and directories on another filesystem are refused.
    Copy {
        #[command(flatten)]
        roots: RootArgs,
        /// The directory to copy (absolute, beneath a root).
        source: PathBuf,
        /// The empty directory to copy into (absolute, beneath a root); it gets the owner,
        /// mode and times of `source`.
        destination: PathBuf,
    },
    /// Serve a volume's credential proxy on loopback ([`crate::storage::credential_proxy`]):
    /// requests with the inner credential are forwarded to `--upstream` with the outer
    /// credential read from `--credentials` at each request (what a plugin's `refresh`
    /// rewrites). Runs until the client recorded in `--client` has exited (or it is
    /// killed); fails when no running client is recorded there within `--client-wait`.
    CredentialProxy {
        /// The server's URL (`http://` or `https://`, with its base path).
        #[arg(long)]
        upstream: String,
        /// The outer credential: `{"user": "…", "password": "…"}` (JSON, mode 0600), read
        /// on each request.
        #[arg(long)]
        credentials: PathBuf,
        /// The inner credential, `user:password` on one line (mode 0600), read at start.
        #[arg(long)]
        inner: PathBuf,
        /// Where to listen (a loopback address; port 0 picks a free one).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
        /// Where to write the port listened on, once listening.
        #[arg(long)]
        port_file: PathBuf,
        /// The file recording the proxy's client (the FUSE server that talks to it):
        /// `PID START`, its process ID and start time (field 22 of `/proc/PID/stat`). The
        /// proxy exits once that process has exited.
        #[arg(long)]
        client: PathBuf,
        /// How long the proxy waits, from its start, for `--client` to name a running
        /// process before it exits (its publish ended before the client started).
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        client_wait: std::time::Duration,
    },
    /// Open paths beneath a storage root (no symlink followed) and run a command with
    /// `{0}`, `{1}`… in its arguments replaced by `/proc/self/fd/N` of each: the `--open`
    /// paths first, then the `--create` ones.
    Exec {
        #[command(flatten)]
        roots: RootArgs,
        /// A path that must exist (file or directory), opened with `O_PATH`.
        #[arg(long = "open")]
        open: Vec<PathBuf>,
        /// A regular file opened read-write, made (mode 0600) if missing.
        #[arg(long = "create")]
        create: Vec<PathBuf>,
        /// The command and its arguments (after `--`).
        #[arg(required = true, last = true)]
        command: Vec<OsString>,
    },
}

/// The storage roots the path-sensitive helpers act beneath.
#[derive(Debug, Clone, clap::Args)]
pub struct RootArgs {
    /// A storage root (repeatable); default: `DHV_VOLUMES_DIR` and the `:`-separated
    /// `DHV_ALLOWED_ROOTS` of the plugin call.
    #[arg(long = "root")]
    root: Vec<PathBuf>,
}

impl RootArgs {
    fn roots(&self) -> Roots {
        if self.root.is_empty() {
            Roots::from_env()
        } else {
            Roots::new(self.root.iter().cloned())
        }
    }

    fn locate(&self, path: &Path) -> Result<Beneath, Failure> {
        self.roots().locate(path).map_err(refused)
    }
}

fn refused(e: BeneathError) -> Failure {
    Failure::new(EXIT_FAILED, e.to_string())
}

/// Runs `helper …`. `run` and `exec` return only on failure (exec replaces this process),
/// `credential-proxy` once its client has exited (saying so on stderr), or on failure.
pub async fn helper_cmd(cmd: HelperCommand) -> Result<(), Failure> {
    match cmd {
        HelperCommand::CredentialProxy {
            upstream,
            credentials,
            inner,
            listen,
            port_file,
            client,
            client_wait,
        } => {
            let end = crate::storage::credential_proxy::serve(
                crate::storage::credential_proxy::ProxyConfig {
                    upstream,
                    credentials,
                    inner,
                    listen,
                    port_file,
                    client,
                    client_wait,
                },
            )
            .await
            .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
            eprintln!("credential proxy: {end}");
            Ok(())
        }
        HelperCommand::Run { cgroup, command } => run(&cgroup, &command),
        HelperCommand::BindMount {
            roots,
            read_only,
            flags,
            source,
            target,
        } => {
            let flags = MountFlags::parse_list(&flags)
                .map_err(|e| Failure::new(EXIT_CONFIG, format!("--flags: {e}")))?;
            beneath::bind_mount(&roots.locate(&source)?, &target, read_only, flags).map_err(refused)
        }
        HelperCommand::Remove { roots, path } => beneath::remove(&roots.locate(&path)?)
            .map(|_| ())
            .map_err(refused),
        HelperCommand::Mkdir {
            roots,
            parents,
            owner,
            mode,
            path,
        } => {
            let attrs = DirAttrs {
                owner: owner.as_deref().map(parse_owner).transpose()?,
                mode: mode
                    .as_deref()
                    .map(|m| {
                        u32::from_str_radix(m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| {
                                Failure::new(
                                    EXIT_CONFIG,
                                    format!("--mode {m:?} is not an octal mode like 0755"),
                                )
                            })
                    })
                    .transpose()?,
            };
            beneath::make_dir(&roots.locate(&path)?, parents, attrs).map_err(refused)
        }
        HelperCommand::Rename { roots, from, to } => {
            beneath::rename(&roots.locate(&from)?, &roots.locate(&to)?).map_err(refused)
        }
        HelperCommand::Copy {
            roots,
            source,
            destination,
        } => crate::node::copy::copy_tree(&roots.locate(&source)?, &roots.locate(&destination)?)
            .map(|_| ())
            .map_err(|e| Failure::new(EXIT_FAILED, e.to_string())),
        HelperCommand::Exec {
            roots,
            open,
            create,
            command,
        } => exec(&roots, &open, &create, &command),
    }
}

fn parse_owner(s: &str) -> Result<(u32, u32), Failure> {
    s.split_once(':')
        .and_then(|(u, g)| Some((u.parse().ok()?, g.parse().ok()?)))
        .ok_or_else(|| {
            Failure::new(
                EXIT_CONFIG,
                format!("--owner {s:?} is not UID:GID (numbers)"),
            )
        })
}

fn run(cgroup: &Path, command: &[OsString]) -> Result<(), Failure> {
    use std::os::unix::process::CommandExt;
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

fn exec(
    roots: &RootArgs,
    open: &[PathBuf],
    create: &[PathBuf],
    command: &[OsString],
) -> Result<(), Failure> {
    use rustix::fd::IntoRawFd;
    use rustix::fs::{Mode, OFlags};
    use std::os::unix::process::CommandExt;
    let mut fds = Vec::new();
    for p in open {
        fds.push(
            roots
                .locate(p)?
                .open(OFlags::PATH, Mode::empty())
                .map_err(refused)?,
        );
    }
    for p in create {
        fds.push(
            roots
                .locate(p)?
                .open(
                    OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(refused)?,
        );
    }
    let mut paths = Vec::new();
    for fd in fds {
        // Kept open across the exec (no FD_CLOEXEC): the command reaches it by number.
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::empty())
            .map_err(|e| Failure::new(EXIT_FAILED, format!("cannot keep a handle open: {e}")))?;
        paths.push(format!("/proc/self/fd/{}", fd.into_raw_fd()));
    }
    let (program, args) = command
        .split_first()
        .ok_or_else(|| Failure::new(EXIT_CONFIG, "no command given after --"))?;
    let args: Vec<OsString> = args
        .iter()
        .map(|a| match a.to_str() {
            Some(text) => {
                let mut s = text.to_string();
                for (i, p) in paths.iter().enumerate() {
                    s = s.replace(&format!("{{{i}}}"), p);
                }
                OsString::from(s)
            }
            None => a.clone(),
        })
        .collect();
    let e = std::process::Command::new(program).args(&args).exec();
    Err(Failure::new(
        EXIT_FAILED,
        format!("cannot run {}: {e}", PathBuf::from(program).display()),
    ))
}
