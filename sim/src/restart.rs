//! `nomad alloc restart` (`client/allocrunner/alloc_runner.go` `RestartTask`/`RestartAll`).

use crate::store::{Server, StoreError};

/// Requests a restart of one task, the running tasks, or all tasks of an allocation.
pub fn request(_server: &Server, _alloc: &str, _task: &str, _all: bool) -> Result<(), StoreError> {
    Err(StoreError::Internal(
        "alloc restart is not simulated yet".into(),
    ))
}
