//! Shared test support: the in-process agent against the simulator's scripted front
//! (`nomad_sim::replay`), recorded Nomad data, a mount-cleaning sandbox, the end-to-end
//! cluster, the jobs its tests submit, the mount namespaces they make, a scratch cgroup, and a WebDAV server on loopback for the FUSE plugin.
pub mod cgroup;
pub mod cluster;
pub mod fixtures;
pub mod inproc;
pub mod jobs;
pub mod namespace;
pub mod sandbox;
pub mod webdav;
