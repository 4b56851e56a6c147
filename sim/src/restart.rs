//! `nomad alloc restart` (`client/client.go` `RestartAllocation` → `client/allocrunner/alloc_runner.go`
//! `RestartTask` / `RestartRunning` / `RestartAll`): requests are broadcast to the client that
//! runs the allocation, which answers on the request's `reply` once the kill is done
//! (`client/allocrunner/taskrunner/lifecycle.go` `restartImpl` waits for the task to exit);
//! a named task that is not running (pending or dead) is refused with "Task not running"
//! (`TaskRunner.Restart`, `ErrTaskNotRunning`), which the HTTP API answers with 500.

use crate::structs::Allocation;

/// A restart request for one allocation.
#[derive(Debug, Clone)]
pub struct RestartRequest {
    /// Allocation ID.
    pub alloc_id: String,
    /// One task, or empty for the running tasks (or all with `all_tasks`).
    pub task: String,
    /// Restart every task, prestart ones included (coordinator back to init).
    pub all_tasks: bool,
    /// Where the client answers: `Ok` once the restarted tasks were killed, or the error.
    pub reply: tokio::sync::mpsc::UnboundedSender<Result<(), String>>,
}

/// Why a restart request is refused (`Allocations.Restart`, `client/alloc_endpoint.go`).
#[derive(Debug, thiserror::Error)]
pub enum RestartError {
    /// 404: no such allocation.
    #[error("Unknown allocation")]
    UnknownAllocation,
    /// 400: the allocation is terminal.
    #[error("Task not running")]
    NotRunning,
    /// 400: a task name together with `AllTasks`.
    #[error("task name cannot be set with all tasks")]
    TaskWithAll,
    /// 400: the task is not in the allocation's group.
    #[error("Could not find task {0:?}")]
    UnknownTask(String),
}

impl RestartRequest {
    /// Validates a request for `alloc` (the stored allocation, `None` when unknown).
    pub fn new(
        alloc: Option<&Allocation>,
        task: &str,
        all: bool,
        reply: tokio::sync::mpsc::UnboundedSender<Result<(), String>>,
    ) -> Result<Self, RestartError> {
        let a = alloc.ok_or(RestartError::UnknownAllocation)?;
        if a.terminal() {
            return Err(RestartError::NotRunning);
        }
        if all && !task.is_empty() {
            return Err(RestartError::TaskWithAll);
        }
        if !task.is_empty() {
            let known = a
                .Job
                .as_ref()
                .and_then(|j| j.group(&a.TaskGroup))
                .is_some_and(|g| g.Tasks.iter().any(|t| t.Name == task));
            if !known {
                return Err(RestartError::UnknownTask(task.into()));
            }
        }
        Ok(RestartRequest {
            alloc_id: a.ID.clone(),
            task: task.into(),
            all_tasks: all,
            reply,
        })
    }
}
