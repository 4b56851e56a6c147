//! Shared test support: a fake Nomad, the in-process agent, a mount-cleaning sandbox, and
//! the end-to-end cluster.
pub mod cluster;
pub mod fake_nomad;
pub mod inproc;
pub mod sandbox;
