//! `nomad alloc restart` (`client/allocrunner/alloc_runner.go` `RestartTask` / `RestartRunning` /
//! `RestartAll`): requests are broadcast to the client that runs the allocation.

use crate::store::{Server, StoreError};

/// A restart request for one allocation.
#[derive(Debug, Clone)]
pub struct RestartRequest {
    /// Allocation ID.
    pub alloc_id: String,
    /// One task, or empty for the running tasks (or all with `all_tasks`).
    pub task: String,
    /// Restart every task, prestart ones included (coordinator back to init).
    pub all_tasks: bool,
}

/// Validates and forwards a restart request to the alloc's client.
pub fn request(server: &Server, alloc: &str, task: &str, all: bool) -> Result<(), StoreError> {
    let a = server
        .read()
        .allocs
        .get(alloc)
        .cloned()
        .ok_or_else(|| StoreError::NotFound("Unknown allocation".into()))?;
    if a.terminal() {
        return Err(StoreError::BadRequest("Task not running".into()));
    }
    if all && !task.is_empty() {
        return Err(StoreError::BadRequest(
            "task name cannot be set with all tasks".into(),
        ));
    }
    if !task.is_empty() {
        let known = a
            .Job
            .as_ref()
            .and_then(|j| j.group(&a.TaskGroup))
            .is_some_and(|g| g.Tasks.iter().any(|t| t.Name == task));
        if !known {
            return Err(StoreError::BadRequest(format!(
                "Could not find task {task:?}"
            )));
        }
    }
    let _ = server.restart_tx.send(RestartRequest {
        alloc_id: alloc.into(),
        task: task.into(),
        all_tasks: all,
    });
    Ok(())
}
