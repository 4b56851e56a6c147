//! Shared test support: a fake Nomad, a mount-cleaning sandbox, and the end-to-end cluster.
pub mod cluster;
pub mod fake_nomad;
pub mod sandbox;
