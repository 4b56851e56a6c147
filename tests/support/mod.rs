//! Shared test support: a fake Nomad and a mount-cleaning sandbox.
pub mod fake_nomad;
pub mod sandbox;
