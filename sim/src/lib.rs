//! nomad-sim: a simulator of the parts of HashiCorp Nomad that dhv-binder relies on.
//!
//! Layout:
//! - `config`: agent config (HCL); `cli`: command line; `agent`: process wiring.
//! - `structs`: Nomad wire types; `jobspec` / `hcl_value`: jobspec parsing; `clock`: time encodings.
//! - `state`: the tables and queued events; `policy`: ACL tables and policy parsing;
//!   `broker`: event ring buffer and filters; `scheduler`: placement over the tables;
//!   `store`: the server (mutations, index, blocking waits); `restart`: `alloc restart` requests.
//! - Over the store: `nodes`: node status/drain/heartbeat; `locks`: variable locks; `acl`:
//!   authorization; `identity`: keyring and workload identities; `deployments`: allocation
//!   health, promotion and completion of deployments.
//! - `api`: HTTP endpoints, one submodule per endpoint family (sim faults in `api::faults`).
//! - `client`: simulated client nodes and alloc runners; `taskrunner`: tasks, restarts, kills;
//!   `restart`: `alloc restart`; `exec_driver`: the exec driver's namespace/chroot helper;
//!   `docker_driver`: the docker driver over a real Docker engine; `cgroup`: the tasks' cgroups.
#![forbid(unsafe_code)]

pub mod acl;
pub mod agent;
pub mod api;
pub mod artifact;
pub mod broker;
pub mod cgroup;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod counters;
pub mod deployments;
pub mod docker_driver;
pub mod exec_driver;
pub mod hcl_value;
pub mod identity;
pub mod jobspec;
pub mod locks;
pub mod nodes;
pub mod policy;
pub mod replay;
pub mod restart;
pub mod scheduler;
pub mod state;
pub mod store;
pub mod structs;
pub mod task_api;
pub mod taskrunner;
