//! The storage plugins: how dhv-binder runs them and what it tells them.
//!
//! - [`plugin`]: the plugin runner (Nomad's DHV protocol extended with publish/unpublish;
//!   docs/plugin-protocol.md);
//! - [`environment`]: the plugin environment contract (the variables of each operation);
//! - [`redact`]: secrets taken out of plugin text in the forms plugins print them;
//! - [`error_class`]: what a failure says about where the call can succeed;
//! - `discovery`: notices plugin files added, changed or removed.

pub(crate) mod discovery;
pub mod environment;
pub mod error_class;
pub mod plugin;
pub mod redact;
