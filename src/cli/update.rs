//! `dhv-binder volume update -availability=active|pause|drain <volume>`: whether new
//! allocations may get a volume (Swarm's `docker volume update --availability`), written
//! into the record's spec and signed with it.

use super::records::{read_var, SigningArgs};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::nomad::{Client, NomadError};
use crate::volume::availability::Availability;

/// The arguments of `volume update`.
#[derive(Debug, clap::Args)]
pub struct UpdateArgs {
    /// `active` (offered and published as usual), `pause` (current users keep the volume, no
    /// new allocation gets it: a waiting prestart fails at once) or `drain` (as pause, and the
    /// volume is unpublished as each user ends; nothing is killed).
    #[arg(long)]
    pub availability: String,
    /// The volume's name, or its ID or a unique prefix of it.
    pub name: String,
    #[command(flatten)]
    pub key: SigningArgs,
}

/// Sets the volume's availability (check-and-set on the record, signed again).
pub async fn update(client: &Client, ns: &str, args: UpdateArgs) -> Result<(), Failure> {
    let to = Availability::parse(&args.availability).ok_or_else(|| {
        Failure::new(
            EXIT_CONFIG,
            format!(
                "-availability {:?} must be active, pause or drain",
                args.availability
            ),
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
    match crate::cluster::changes::put_record(client, &rec.to_variable(), Some(rec.modify_index))
        .await
    {
        Ok(_) => {}
        Err(NomadError::CasConflict { .. }) => {
            return Err(Failure::new(
                EXIT_FAILED,
                format!("volume {} changed meanwhile; try again", rec.key()),
            ))
        }
        Err(e) => return Err(e.into()),
    }
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
