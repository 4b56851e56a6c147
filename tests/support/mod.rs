//! Shared test support: a fake Nomad, the in-process agent, a mount-cleaning sandbox, the
//! end-to-end cluster, and a WebDAV server on loopback for the FUSE plugin.
pub mod cluster;
pub mod fake_nomad;
pub mod fixtures;
pub mod inproc;
pub mod sandbox;
pub mod webdav;
