//! `dhv-binder volume create|register|list|status|delete|deregister|keygen`: the
//! cluster-wide volume records in Nomad Variables (see [`crate::volume`]), signed with the
//! operator's key ([`crate::cluster::trust`]). One file per concept: [`show`] (`list`,
//! `status` and their forms), [`create`] (`create`, `register` and the wait for the agents),
//! [`eligibility`] (which nodes can serve a volume, and why none acts), [`remove`]
//! (`delete`, `deregister`), [`unpublish`] (an operator's forced unpublish on one node),
//! [`orphans`] (storage without records and records without storage).

pub mod create;
pub mod eligibility;
pub mod offering;
pub mod orphans;
pub mod remove;
pub mod show;
pub mod unpublish;

use super::claim::ClaimCommand;
use super::output::OutputArgs;
use super::records::SigningArgs;
use super::storage::{self, LocalPlugins, SnapshotCommand};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::cluster::trust::SigningKey;
use crate::config::NomadConfig;
use crate::nomad::Client;
use clap::Subcommand;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Create a deferred volume from an HCL spec (like `nomad volume create`): fails at once
    /// when no live node has the plugin (deferred and healthy) in the spec's node pool. Given
    /// again for an existing volume with a larger `capacity_min`, grows it (plugin capability
    /// "expand"); shrinking or changing anything else is refused.
    Create {
        /// The volume spec (HCL) file, or `-` to read it from standard input.
        spec: PathBuf,
        /// Write nothing: say which nodes would offer the volume, which plugin would create
        /// it, and what would be refused (exit 1 when the create would be).
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        local: LocalPlugins,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Snapshot volumes, list and delete snapshots (like `nomad volume snapshot`).
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Claims of single-node volumes: `volume claim release` (the operator's override).
    #[command(subcommand)]
    Claim(ClaimCommand),
    /// Register a volume that already exists in the storage (like `nomad volume register`):
    /// no plugin `create` runs; the spec's `context { ... }` block is what the plugin's
    /// create would have returned (e.g. `export_path` for the bind plugin), `capacity` its size.
    Register {
        /// The register spec (HCL) file, with a `context { ... }` block and `capacity`, or
        /// `-` to read it from standard input.
        spec: PathBuf,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Make an operator signing key: writes the private key (mode 0600) and prints the public
    /// key line for each node's --record-keys file (docs/security.md).
    Keygen {
        /// Where to write the private key; refused if it exists.
        out: PathBuf,
    },
    /// List deferred volumes.
    List {
        /// Only volumes no allocation has used for at least this long on any node (`720h`),
        /// and those never used, with when their last user left (node records).
        #[arg(long, value_parser = humantime::parse_duration)]
        unused: Option<Duration>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// The orphan report: ask a plugin installed on this machine what its storage holds
    /// (capability "list") and name storage no record names and ready records whose
    /// storage is gone. Changes nothing. `-namespace '*'` compares with every namespace.
    Orphans(orphans::OrphanArgs),
    /// Show one volume: record, allocations using it.
    Status {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Delete a volume (the plugin's `delete` destroys its storage); refused while any
    /// allocation uses it, and for registered volumes (use `deregister`).
    Delete {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Unpublish a volume on one node for an operator (its agent acts on a signed request
    /// and answers; audited on the node). Refused without -force while an allocation there
    /// runs with it: with -force its tasks lose the volume and do not get it back while they
    /// run. Refused while a process holds the mount unless -kill (killed as the fence kills).
    Unpublish {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
        /// The node: its name, or its ID or a unique prefix of it.
        #[arg(long)]
        node: String,
        /// Unpublish even while allocations on the node run with the volume.
        #[arg(long)]
        force: bool,
        /// Kill the processes that hold the mount (as the fence does) instead of refusing.
        #[arg(long)]
        kill: bool,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Set whether new allocations may get a volume: `-availability=active|pause|drain`; or
    /// clear a "final" publish failure once the storage is repaired: `-repaired`.
    Update(super::update::UpdateArgs),
    /// Remove a volume's record without calling the plugin's `delete`: the storage stays.
    /// Refused while any allocation uses it.
    Deregister {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
    },
}

/// How long a command that changes a volume waits for the agents to act on it.
#[derive(Debug, Clone, clap::Args)]
pub struct WaitArgs {
    /// Return once the record is written, without waiting for the agents.
    #[arg(long)]
    pub detach: bool,
    /// How long to wait for the agents (e.g. `30s`, `5m`); past it the command gives up
    /// with exit 75, saying why no agent acted (the record stays).
    #[arg(long, default_value = DEFAULT_WAIT, value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl WaitArgs {
    /// How long to wait; `None` with `-detach`.
    pub fn wait(&self) -> Option<Duration> {
        (!self.detach).then_some(self.timeout)
    }
}

/// Writes a new operator key to `out` (created, mode 0600) and prints its public key line.
fn keygen(out: &Path) -> Result<(), Failure> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let (key, text) =
        SigningKey::generate().map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(|e| Failure::new(EXIT_CONFIG, format!("cannot create {}: {e}", out.display())))?;
    f.write_all(text.as_bytes())
        .map_err(|e| Failure::new(EXIT_FAILED, format!("{}: {e}", out.display())))?;
    outln!("{}", key.public_line());
    Ok(())
}

/// How long `volume create` and `volume delete` wait for the agents, unless `-detach`.
pub const DEFAULT_WAIT: &str = "2m";

/// Runs a `volume` subcommand.
pub async fn volume_cmd(nomad: &NomadConfig, cmd: VolumeCommand) -> Result<(), Failure> {
    let client = Client::new(nomad)?;
    let ns = nomad.namespace.as_str();
    match cmd {
        VolumeCommand::Keygen { out } => keygen(&out),
        VolumeCommand::Create {
            spec,
            dry_run: true,
            local,
            key,
            ..
        } => create::dry_run(&client, ns, &spec, &local, key.load()?.as_ref()).await,
        VolumeCommand::Create {
            spec,
            wait,
            local,
            key,
            ..
        } => create::create(&client, ns, &spec, wait.wait(), &local, key.load()?).await,
        VolumeCommand::Snapshot(cmd) => storage::snapshot_cmd(&client, ns, cmd).await,
        VolumeCommand::Claim(cmd) => super::claim::claim_cmd(&client, ns, cmd).await,
        VolumeCommand::Register { spec, key } => {
            create::register(&client, ns, spec, key.load()?).await
        }
        VolumeCommand::List { unused, out } => show::list(&client, ns, unused, out).await,
        VolumeCommand::Status { name, out } => show::status(&client, ns, name, out).await,
        VolumeCommand::Orphans(args) => orphans::orphans(&client, ns, args).await,
        VolumeCommand::Delete { name, wait, key } => {
            remove::delete(&client, ns, name, wait.wait(), key.load()?).await
        }
        VolumeCommand::Deregister { name } => remove::deregister(&client, ns, name).await,
        VolumeCommand::Update(args) => super::update::update(&client, ns, args).await,
        VolumeCommand::Unpublish {
            name,
            node,
            force,
            kill,
            wait,
            key,
        } => {
            let args = unpublish::UnpublishArgs {
                name,
                node,
                force,
                kill,
                wait: wait.wait(),
            };
            unpublish::unpublish(&client, ns, args, key).await
        }
    }
}
