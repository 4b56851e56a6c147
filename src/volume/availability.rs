//! A volume's availability (Swarm's cluster volume model): `active`, `pause` or `drain`,
//! set by `dhv-binder volume update -availability=…` and signed with the spec.

use serde::{Deserialize, Serialize};

/// Whether new allocations may get the volume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Availability {
    /// Offered and published as usual.
    #[default]
    Active,
    /// Current users keep the volume; no new allocation gets it (no placeholder where it is
    /// not published, a waiting prestart is refused at once).
    Pause,
    /// As [`Availability::Pause`]; the volume is unpublished as each user ends (nothing is
    /// killed), after which `volume delete` proceeds.
    Drain,
}

impl Availability {
    /// The word of the record and of `-availability`.
    pub fn as_str(self) -> &'static str {
        match self {
            Availability::Active => "active",
            Availability::Pause => "pause",
            Availability::Drain => "drain",
        }
    }

    /// `active`, `pause` or `drain`; `None` for anything else.
    pub fn parse(word: &str) -> Option<Availability> {
        match word {
            "active" => Some(Availability::Active),
            "pause" => Some(Availability::Pause),
            "drain" => Some(Availability::Drain),
            _ => None,
        }
    }

    /// True for [`Availability::Active`] (omitted from the record).
    pub fn is_active(&self) -> bool {
        matches!(self, Availability::Active)
    }
}

impl std::fmt::Display for Availability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
