//! The prestart gate: which tasks of an allocation could start on a deferred volume before
//! it is published.
//!
//! Nomad starts an allocation's main tasks only after every non-sidecar prestart task has
//! exited successfully, and starts all prestart tasks together
//! (`client/allocrunner/tasklifecycle/coordinator.go`, `isPrestartDone`). So a task that
//! mounts a deferred volume is gated when it is a main, poststart or poststop task and its
//! group has a gate: a non-sidecar prestart task that mounts the agent's socket volume (it
//! runs `dhv-binder prestart` or calls the socket itself). Any other such task may start on
//! the empty placeholder: the agent says so in its log and status. Such a task cannot write
//! to the node's disk (the placeholder is read-only, `node::guard`), and a bind made before
//! the publish does not show the volume unless the mount propagates into the task
//! (`propagation_mode` `host-to-task` or `bidirectional`); for the others the agent restarts
//! such a task (if it runs) once the volume is published ([`restart_on_publish`]).

use crate::agent::view::Request;
use crate::nomad::types::{Allocation, TaskGroup};
use crate::volume::VolumeKey;
use serde::Serialize;

/// The host volume (a static `host_volume` on every client) that carries the agent's
/// socket to prestart tasks, as in jobspecs/dhv-binder.nomad.hcl.
pub const SOCKET_VOLUME: &str = "dhv-binder-socket";

/// How many ungated tasks whose allocation ended before the publish the agent reports.
pub const EXITED_KEPT: usize = 64;

/// Why a task is not gated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The group has no non-sidecar prestart task mounting the socket volume.
    NoGate,
    /// The task is a prestart task itself: it starts together with the gate.
    StartsWithGate,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reason::NoGate => "its group has no prestart task (lifecycle prestart, sidecar false) mounting the dhv-binder socket volume, so it may start before the volume is published",
            Reason::StartsWithGate => "it is a prestart task, started together with the prestart gate, before the volume is published",
        })
    }
}

/// A task that mounts a deferred volume without waiting for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Ungated {
    pub job: String,
    pub group: String,
    pub task: String,
    pub volume: VolumeKey,
    pub reason: Reason,
    /// True when every `volume_mount` of the volume in the task propagates later mounts into
    /// it (`host-to-task`, `bidirectional`): the task sees the volume once it is published,
    /// without a restart.
    pub sees_later_mounts: bool,
}

/// Whether a `volume_mount`'s `propagation_mode` carries a mount made on the host after the
/// task started into the task: Nomad's `host-to-task` and `bidirectional` (rslave, rshared);
/// `private`, the default, does not (`drivers/docker/driver.go`, and the exec driver's
/// libcontainer mounts).
pub fn propagates(mode: &str) -> bool {
    matches!(mode, "host-to-task" | "bidirectional")
}

/// The tasks to restart once `volume` is published, as (allocation ID, task name): those
/// that mount it ungated and do not see later mounts (they may have been started on the
/// empty placeholder). Only a running task is restarted: one that has not started yet starts
/// on the published volume anyway. A restart naming a task that is not running (pending or
/// dead) is refused by Nomad with 500 "Task not running" (`client/client.go`
/// `RestartAllocation` → `client/allocrunner/alloc_runner.go` `RestartTask` →
/// `client/allocrunner/taskrunner/lifecycle.go` `TaskRunner.Restart`, `ErrTaskNotRunning`);
/// the agent logs that as nothing to restart. A restart of a running task answers once the
/// task was killed (`restartImpl` waits for it to exit).
pub fn restart_on_publish(
    ungated: &std::collections::BTreeMap<String, Vec<Ungated>>,
    volume: &VolumeKey,
) -> Vec<(String, String)> {
    ungated
        .iter()
        .flat_map(|(id, us)| {
            us.iter()
                .filter(|u| &u.volume == volume && !u.sees_later_mounts)
                .map(move |u| (id.clone(), u.task.clone()))
        })
        .collect()
}

impl std::fmt::Display for Ungated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {:?} group {:?} task {:?} mounts deferred volume {} but {}; until it is published the task sees an empty read-only directory, {}",
            self.job,
            self.group,
            self.task,
            self.volume,
            self.reason,
            if self.sees_later_mounts {
                "then the volume reaches it without a restart (propagation_mode host-to-task or bidirectional)"
            } else {
                "and once it is published the agent restarts the task onto it"
            }
        )
    }
}

/// The tasks of `alloc` that mount one of its deferred volumes (`requests`, from
/// [`crate::agent::view::requests`]) without the gate; `socket_volume` is the source of the
/// socket's host volume ([`SOCKET_VOLUME`] by default). Empty without the allocation's Job.
pub fn ungated(alloc: &Allocation, requests: &[Request], socket_volume: &str) -> Vec<Ungated> {
    let Some(group) = alloc.group() else {
        return Vec::new();
    };
    let gated = has_gate(group, socket_volume);
    let mut out = Vec::new();
    for task in &group.tasks {
        let prestart = task
            .lifecycle
            .as_ref()
            .is_some_and(|l| l.hook == "prestart");
        let reason = match (prestart, gated) {
            (true, _) => Reason::StartsWithGate,
            (false, false) => Reason::NoGate,
            (false, true) => continue,
        };
        for m in &task.volume_mounts {
            let Some(volume) = deferred_key(alloc, group, &m.volume, requests) else {
                continue;
            };
            let sees = propagates(&m.propagation_mode);
            if let Some(u) = out
                .iter_mut()
                .find(|u: &&mut Ungated| u.task == task.name && u.volume == volume)
            {
                u.sees_later_mounts &= sees;
                continue;
            }
            out.push(Ungated {
                job: alloc.job_id.to_string(),
                group: group.name.to_string(),
                task: task.name.to_string(),
                volume,
                reason,
                sees_later_mounts: sees,
            });
        }
    }
    out
}

/// The tasks of `alloc` that mount `volume` read-only (the group's `volume { read_only }` or
/// the mount's own `read_only`) with a `propagation_mode` that carries later mounts into
/// them ([`propagates`]). A mount made on the placeholder after such a task was bound
/// reaches it as a copy with the host mount's flags: a writer volume's `rw` (issue 44 §4),
/// whatever the task asked. Empty without the allocation's Job.
pub fn read_only_propagating(alloc: &Allocation, volume: &VolumeKey) -> Vec<String> {
    let Some(group) = alloc.group() else {
        return Vec::new();
    };
    if *alloc.namespace != *volume.namespace {
        return Vec::new();
    }
    let names = |alias: &str| -> Option<bool> {
        let req = group.volumes.get(alias)?;
        if req.volume_type != "host" {
            return None;
        }
        let name = if req.per_alloc {
            format!("{}{}", req.source, alloc.alloc_suffix()?)
        } else {
            req.source.to_string()
        };
        (*name == *volume.name).then_some(req.read_only)
    };
    group
        .tasks
        .iter()
        .filter(|t| {
            t.volume_mounts.iter().any(|m| {
                names(&m.volume).is_some_and(|group_ro| {
                    (group_ro || m.read_only) && propagates(&m.propagation_mode)
                })
            })
        })
        .map(|t| t.name.to_string())
        .collect()
}

/// True when the group has a non-sidecar prestart task mounting the socket volume.
fn has_gate(group: &TaskGroup, socket_volume: &str) -> bool {
    group.tasks.iter().any(|t| {
        t.lifecycle
            .as_ref()
            .is_some_and(|l| l.hook == "prestart" && !l.sidecar)
            && t.volume_mounts.iter().any(|m| {
                group
                    .volumes
                    .get(&m.volume)
                    .is_some_and(|v| v.volume_type == "host" && v.source == socket_volume)
            })
    })
}

/// The deferred volume a task's `volume_mount { volume = alias }` refers to.
fn deferred_key(
    alloc: &Allocation,
    group: &TaskGroup,
    alias: &str,
    requests: &[Request],
) -> Option<VolumeKey> {
    let req = group.volumes.get(alias)?;
    if req.volume_type != "host" {
        return None;
    }
    let name = if req.per_alloc {
        format!("{}{}", req.source, alloc.alloc_suffix()?)
    } else {
        req.source.to_string()
    };
    requests
        .iter()
        .find(|r| *r.volume.namespace == *alloc.namespace && *r.volume.name == *name)
        .map(|r| r.volume.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nomad::types::{Job, Lifecycle, Task, VolumeMount, VolumeRequest};

    fn host(source: &str, per_alloc: bool) -> VolumeRequest {
        VolumeRequest {
            name: source.into(),
            volume_type: "host".into(),
            source: source.into(),
            per_alloc,
            ..VolumeRequest::default()
        }
    }

    fn task(name: &str, hook: Option<(&str, bool)>, mounts: &[&str]) -> Task {
        Task {
            name: name.into(),
            driver: "exec".into(),
            lifecycle: hook.map(|(h, sidecar)| Lifecycle {
                hook: h.into(),
                sidecar,
            }),
            volume_mounts: mounts
                .iter()
                .map(|v| VolumeMount {
                    volume: (*v).into(),
                    destination: format!("/{v}").into(),
                    ..VolumeMount::default()
                })
                .collect(),
            ..Task::default()
        }
    }

    fn alloc(tasks: Vec<Task>) -> Allocation {
        let mut g = TaskGroup {
            name: "app".into(),
            tasks,
            ..TaskGroup::default()
        };
        g.volumes.insert("data".into(), host("shared", false));
        g.volumes.insert("shard".into(), host("shard", true));
        g.volumes.insert("sock".into(), host(SOCKET_VOLUME, false));
        g.volumes.insert("local".into(), host("node-disk", false));
        Allocation {
            id: "a1".into(),
            namespace: "default".into(),
            name: "demo.app[2]".into(),
            job_id: "demo".into(),
            task_group: "app".into(),
            job: Some(std::sync::Arc::new(Job {
                id: "demo".into(),
                task_groups: vec![g],
                ..Job::default()
            })),
            ..Allocation::default()
        }
    }

    fn requests() -> Vec<Request> {
        ["shared", "shard[2]"]
            .iter()
            .map(|n| Request {
                volume: VolumeKey {
                    namespace: "default".into(),
                    name: (*n).into(),
                },
                read_only: false,
            })
            .collect()
    }

    fn names(u: &[Ungated]) -> Vec<(String, String, Reason)> {
        u.iter()
            .map(|u| (u.task.clone(), u.volume.name.to_string(), u.reason))
            .collect()
    }

    const GATE: Option<(&str, bool)> = Some(("prestart", false));

    #[test]
    fn a_gated_group_reports_nothing() {
        let a = alloc(vec![
            task("publish", GATE, &["sock"]),
            task("main", None, &["data", "shard", "local"]),
            task("after", Some(("poststart", false)), &["data"]),
            task("cleanup", Some(("poststop", false)), &["data"]),
        ]);
        assert!(ungated(&a, &requests(), SOCKET_VOLUME).is_empty());
    }

    #[test]
    fn no_gate_names_every_task_and_volume() {
        let a = alloc(vec![task(
            "main",
            None,
            &["data", "shard", "local", "data"],
        )]);
        let u = ungated(&a, &requests(), SOCKET_VOLUME);
        assert_eq!(
            names(&u),
            vec![
                ("main".into(), "shared".into(), Reason::NoGate),
                ("main".into(), "shard[2]".into(), Reason::NoGate)
            ]
        );
        assert_eq!((u[0].job.as_str(), u[0].group.as_str()), ("demo", "app"));
        assert!(u[0].to_string().contains("job \"demo\" group \"app\""));
    }

    #[test]
    fn a_sidecar_or_socketless_prestart_is_no_gate() {
        for gate in [
            task("publish", Some(("prestart", true)), &["sock"]),
            task("publish", GATE, &["local"]),
            task("publish", Some(("poststart", false)), &["sock"]),
        ] {
            let a = alloc(vec![gate, task("main", None, &["data"])]);
            let u = ungated(&a, &requests(), SOCKET_VOLUME);
            assert_eq!(
                names(&u),
                vec![("main".into(), "shared".into(), Reason::NoGate)]
            );
        }
    }

    #[test]
    fn a_prestart_task_on_the_volume_starts_with_the_gate() {
        let a = alloc(vec![
            task("publish", GATE, &["sock"]),
            task("seed", Some(("prestart", false)), &["data"]),
            task("main", None, &["data"]),
        ]);
        assert_eq!(
            names(&ungated(&a, &requests(), SOCKET_VOLUME)),
            vec![("seed".into(), "shared".into(), Reason::StartsWithGate)]
        );
    }

    #[test]
    fn only_tasks_that_do_not_see_later_mounts_are_restarted_on_publish() {
        let mut follows = task("follows", None, &["data"]);
        follows.volume_mounts[0].propagation_mode = "host-to-task".into();
        let mut mixed = task("mixed", None, &["shard", "shard"]);
        mixed.volume_mounts[0].propagation_mode = "bidirectional".into();
        let a = alloc(vec![follows, mixed]);
        let u = ungated(&a, &requests(), SOCKET_VOLUME);
        assert_eq!(
            u.iter()
                .map(|u| (u.task.as_str(), u.sees_later_mounts))
                .collect::<Vec<_>>(),
            vec![("follows", true), ("mixed", false)]
        );
        assert!(u[0].to_string().contains("without a restart"), "{}", u[0]);
        assert!(u[1].to_string().contains("restarts"), "{}", u[1]);
        let by_alloc = std::collections::BTreeMap::from([("a1".to_string(), u)]);
        let key = |n: &str| VolumeKey {
            namespace: "default".into(),
            name: n.into(),
        };
        assert!(restart_on_publish(&by_alloc, &key("shared")).is_empty());
        assert_eq!(
            restart_on_publish(&by_alloc, &key("shard[2]")),
            vec![("a1".to_string(), "mixed".to_string())]
        );
        assert!(restart_on_publish(&by_alloc, &key("other")).is_empty());
    }

    #[test]
    fn another_socket_volume_name_and_no_job() {
        let a = alloc(vec![
            task("publish", GATE, &["local"]),
            task("main", None, &["data"]),
        ]);
        assert!(ungated(&a, &requests(), "node-disk").is_empty());
        let mut bare = a.clone();
        bare.job = None;
        assert!(ungated(&bare, &requests(), SOCKET_VOLUME).is_empty());
    }
}
