//! nomad-sim: a simulator of the parts of HashiCorp Nomad that dhv-binder relies on.
//!
//! Layout:
//! - `config`: agent config (HCL); `cli`: command line; `agent`: process wiring.
//! - `structs`: Nomad wire types; `jobspec` / `hcl_value`: jobspec parsing; `clock`: time encodings.
//! - `store`: server state + index + events; `broker`: event ring buffer and filters;
//!   `scheduler`: placement; `nodes`: node status/drain/heartbeat; `locks`: variable locks;
//!   `acl`: tokens and policies; `identity`: keyring and workload identities; `faults`: sim faults.
//! - `api`: HTTP endpoints.
//! - `client`: simulated client nodes and alloc runners; `taskrunner`: tasks, restarts, kills;
//!   `restart`: `alloc restart`; `exec_driver`: the exec driver's namespace/chroot helper.
#![forbid(unsafe_code)]

pub mod acl;
pub mod agent;
pub mod api;
pub mod broker;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod exec_driver;
pub mod faults;
pub mod hcl_value;
pub mod identity;
pub mod jobspec;
pub mod locks;
pub mod nodes;
pub mod replay;
pub mod restart;
pub mod scheduler;
pub mod store;
pub mod structs;
pub mod task_api;
pub mod taskrunner;
