//! The storage plugins: how dhv-binder runs them and what it tells them.
//!
//! - [`plugin`]: the plugin runner (Nomad's DHV protocol extended with publish/unpublish;
//!   docs/plugin-protocol.md), re-exporting the protocol's words;
//! - [`protocol`]: the operations, capabilities, fingerprint, what each operation prints,
//!   and a call that did not succeed;
//! - `process`: the processes of one call (output, leftovers, the kill at a timeout);
//! - [`environment`]: the plugin environment contract (the variables of each operation);
//! - [`secrets`]: the secrets a volume references, read where they live at each call;
//! - [`redact`]: secrets taken out of plugin text in the forms plugins print them;
//! - [`error_class`]: what a failure says about where the call can succeed;
//! - [`credential_proxy`]: a volume's credential proxy, so that a FUSE remote's
//!   credentials change without an unmount (`helper credential-proxy`);
//! - [`volume_health`]: what the optional `stats`, `health` and `list` operations print;
//! - `discovery`: notices plugin files added, changed or removed.

pub mod credential_proxy;
pub(crate) mod discovery;
pub mod environment;
pub mod error_class;
pub mod plugin;
mod process;
pub mod protocol;
pub mod redact;
pub mod secrets;
pub mod volume_health;
