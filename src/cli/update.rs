//! `dhv-binder volume update -availability=active|pause|drain <volume>`: whether new
//! allocations may get a volume (Swarm's `docker volume update --availability`), written
//! into the record's spec and signed with it. `dhv-binder volume update -repaired <volume>`:
//! clears the volume's "final" publish failure ([`crate::volume::final_failure`]), so that
//! the nodes offer it again.

use super::records::{read_var, SigningArgs};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::nomad::{Client, NomadError};
use crate::volume::availability::Availability;
use crate::volume::VolumeRecord;

/// The arguments of `volume update`.
#[derive(Debug, clap::Args)]
pub struct UpdateArgs {
    /// `active` (offered and published as usual), `pause` (current users keep the volume, no
    /// new allocation gets it: a waiting prestart fails at once) or `drain` (as pause, and the
    /// volume is unpublished as each user ends; nothing is killed).
    #[arg(long, required_unless_present = "repaired")]
    pub availability: Option<String>,
    /// The volume's storage was repaired: clear the "final" publish failure a node wrote
    /// into its record (every node withholds the volume while it is set). Not signed (nodes
    /// write it too).
    #[arg(long)]
    pub repaired: bool,
    /// The volume's name, or its ID or a unique prefix of it.
    pub name: String,
    #[command(flatten)]
    pub key: SigningArgs,
}

/// Sets the volume's availability (check-and-set on the record, signed again), or clears
/// its "final" publish failure (`-repaired`).
pub async fn update(client: &Client, ns: &str, args: UpdateArgs) -> Result<(), Failure> {
    if args.repaired {
        if args.availability.is_some() {
            return Err(Failure::new(
                EXIT_CONFIG,
                "-repaired and -availability are separate updates: run them one at a time",
            ));
        }
        return repaired(client, ns, &args.name).await;
    }
    let word = args.availability.unwrap_or_default();
    let to = Availability::parse(&word).ok_or_else(|| {
        Failure::new(
            EXIT_CONFIG,
            format!("-availability {word:?} must be active, pause or drain"),
        )
    })?;
    let key = args.key.load()?;
    let (mut rec, _) = read_var(client, ns, &args.name).await?;
    if rec.spec.availability == to {
        outln!("==> Volume {} is already {to}", rec.key());
        return Ok(());
    }
    let from = rec.spec.availability;
    rec.spec.availability = to;
    match &key {
        Some(k) => k.sign(&mut rec),
        None if !rec.signature.is_empty() => {
            return Err(Failure::new(
                EXIT_CONFIG,
                format!("volume {} is signed and its availability is part of its spec: give the operator's key (--signing-key or DHV_BINDER_SIGNING_KEY)", rec.key()),
            ))
        }
        None => {}
    }
    put_checked(client, &rec).await?;
    outln!(
        "==> Volume {} availability {from} -> {to}{}",
        rec.key(),
        match to {
            Availability::Active => "",
            Availability::Pause => ": current users keep it, no new allocation gets it",
            Availability::Drain => {
                ": current users keep it, it is unpublished as each ends, no new allocation gets it"
            }
        }
    );
    Ok(())
}

/// Clears the record's "final" publish failure (check-and-set).
async fn repaired(client: &Client, ns: &str, name: &str) -> Result<(), Failure> {
    let (mut rec, _) = read_var(client, ns, name).await?;
    let Some(f) = rec.final_failure.take() else {
        outln!(
            "==> Volume {} has no \"final\" publish failure: nothing to clear",
            rec.key()
        );
        return Ok(());
    };
    put_checked(client, &rec).await?;
    outln!(
        "==> Volume {}: the \"final\" publish failure seen on node {} is cleared ({}); the nodes offer it again",
        rec.key(),
        if f.node_name.is_empty() { &f.node_id } else { &f.node_name },
        f.error
    );
    Ok(())
}

/// Writes `rec` back with a check-and-set on the index it was read at (Nomad API:
/// `PUT /v1/var/:path?cas=<ModifyIndex>`, with the change marker): another writer's update
/// in between fails with "changed meanwhile; try again" (exit 1).
async fn put_checked(client: &Client, rec: &VolumeRecord) -> Result<(), Failure> {
    match crate::cluster::changes::put_record(client, &rec.to_variable(), Some(rec.modify_index))
        .await
    {
        Ok(_) => Ok(()),
        Err(NomadError::CasConflict { .. }) => Err(Failure::new(
            EXIT_FAILED,
            format!("volume {} changed meanwhile; try again", rec.key()),
        )),
        Err(e) => Err(e.into()),
    }
}
