//! Ungated tasks (a group without the prestart gate) once their volume is published.
use super::*;
use crate::nomad::types::{Task, TaskState, VolumeMount};

/// A running allocation of a group without the gate: `app` mounts volume `d` and exited
/// (on the empty placeholder), `side` runs on.
fn alloc_with_exited_ungated_task() -> crate::nomad::types::Allocation {
    let mut a = alloc(A1, &["d"], "running", "run");
    let task = |name: &str, mounts: bool| Task {
        name: name.into(),
        driver: "exec".into(),
        volume_mounts: if mounts {
            vec![VolumeMount {
                volume: "v-d".into(),
                destination: "/data".into(),
                ..VolumeMount::default()
            }]
        } else {
            Vec::new()
        },
        ..Task::default()
    };
    std::sync::Arc::make_mut(a.job.as_mut().unwrap()).task_groups[0].tasks =
        vec![task("app", true), task("side", false)];
    let state = |s: &str| TaskState {
        state: s.into(),
        ..TaskState::default()
    };
    a.task_states.insert("app".into(), state("dead"));
    a.task_states.insert("side".into(), state("running"));
    a
}

/// Issue 46, item 5: an ungated task that already exited is not running, and Nomad refuses
/// to restart it by name ("Task not running"): the publish restarts the allocation's tasks
/// all (`AllTasks`), which starts the exited one again, onto the volume.
#[test]
fn a_publish_restarts_an_ungated_task_that_already_exited() {
    let mut h = H::new(
        &[("d", "multi-node-multi-writer")],
        vec![alloc_with_exited_ungated_task()],
    );
    assert_eq!(h.core.status()["ungated"][A1][0]["task"], "app");
    let e = h.published("d");
    let restarts: Vec<_> = e
        .iter()
        .filter_map(|x| match x {
            Effect::RestartAlloc {
                alloc_id,
                task,
                all_tasks,
                ..
            } => Some((alloc_id.as_str(), task.clone(), *all_tasks)),
            _ => None,
        })
        .collect();
    assert_eq!(restarts, vec![(A1, None, true)], "{e:?}");
}
