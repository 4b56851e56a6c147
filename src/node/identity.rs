//! Whose process: the Nomad task (allocation and task) or the container a process runs in,
//! read from its cgroup (`/proc/<pid>/cgroup`), which the kernel keeps and the process cannot
//! change. Never from its environment: `NOMAD_ALLOC_ID` is a variable any process sets as it
//! likes (`env NOMAD_ALLOC_ID=<anything> ...`).
//!
//! Nomad starts every task of the `raw_exec` and `exec` drivers, and all it forks, in a cgroup
//! of its own (`client/lib/cgroupslib/editor.go`, `Factory`):
//! - cgroups v2: `<cgroup_parent>/<partition>/<alloc id>.<task>.scope` (`pathCG2`,
//!   `scopeCG2`), partition `share.slice` or `reserve.slice` (`partition.go`
//!   `SharePartition`, `ReservePartition`), the client's `cgroup_parent` `nomad.slice` by
//!   default (`switch_linux.go` `defaultParent`);
//! - cgroups v1: `<cgroup_parent>/<alloc id>.<task>` in the `freezer`, `cpu` and `memory`
//!   hierarchies, and `<cgroup_parent>/reserve/<alloc id>.<task>` in `cpuset` for reserved
//!   cores (`lifeCG1.paths`, `ScopeCG1`), `cgroup_parent` `/nomad` by default.
//!
//! A docker task runs in its container's cgroup (`drivers/docker/handle.go` `dockerCgroup`:
//! `system.slice/docker-<id>.scope` with docker's systemd driver, `docker/<id>` with
//! cgroupfs), and Nomad labels the container with the allocation
//! (`com.hashicorp.nomad.alloc_id`, `drivers/docker/driver.go` `createContainerConfig`): the
//! cgroup names the container, not the allocation.
//!
//! Moving a process to another cgroup takes write access to `cgroup.procs` of both cgroups'
//! common ancestor (cgroup-v2.rst, "Delegation Containment"): a task cannot leave its cgroup
//! unless it is root on the host with the cgroup filesystem writable (a `raw_exec` task run as
//! root, which can kill the agent too). Paths are read as the agent's cgroup namespace shows
//! them: the agent runs in the host's (a `raw_exec` task); a cgroup outside its namespace shows
//! as `/..` and matches nothing.
//!
//! Several simulated Nomad clients on one host (the test clusters, docs/simulator.md) have each
//! their own `cgroup_parent`; the operator names the cgroups of the other nodes
//! (`--other-node-cgroup`), so that one node's fence leaves another node's tasks alone.

use std::sync::OnceLock;

/// The cgroups this node's Nomad client runs its tasks in, and those of other nodes simulated
/// on the same host: operator configuration (`--nomad-cgroup-parent`, `--other-node-cgroup`),
/// never anything a task controls. Paths are cgroup paths as `/proc/<pid>/cgroup` shows them,
/// without their leading `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCgroups {
    /// The client's `cgroup_parent` in the cgroup v2 hierarchy (`nomad.slice` by default).
    pub parent_v2: String,
    /// The client's `cgroup_parent` in the cgroup v1 hierarchies (`nomad` by default).
    pub parent_v1: String,
    /// Cgroups (v2) whose processes are on other nodes simulated on this host: the fence does
    /// not kill them and an unpublish does not wait for them. Empty on a real node.
    pub other_nodes: Vec<String>,
}

impl Default for NodeCgroups {
    /// Nomad's defaults (`defaultParent`), no other node.
    fn default() -> Self {
        Self {
            parent_v2: "nomad.slice".into(),
            parent_v1: "nomad".into(),
            other_nodes: Vec::new(),
        }
    }
}

impl NodeCgroups {
    /// From the settings: `parent` is the Nomad client's `cgroup_parent` (`None`: Nomad's
    /// defaults), `other_nodes` the cgroups of other simulated nodes. Each may be a directory
    /// under `cgroup2_mount` (the cgroup2 filesystem's mount point: it is stripped) or a cgroup
    /// path.
    pub fn from_settings(
        parent: Option<&str>,
        other_nodes: &[String],
        cgroup2_mount: Option<&std::path::Path>,
    ) -> Self {
        let rel = |p: &str| -> String {
            let path = std::path::Path::new(p);
            let inner = cgroup2_mount
                .and_then(|m| path.strip_prefix(m).ok())
                .unwrap_or(path);
            inner.to_string_lossy().trim_matches('/').to_string()
        };
        let mut out = Self::default();
        if let Some(p) = parent {
            out.parent_v2 = rel(p);
            out.parent_v1 = rel(p);
        }
        out.other_nodes = other_nodes
            .iter()
            .map(|p| rel(p))
            .filter(|p| !p.is_empty())
            .collect();
        out
    }
}

static NODE: OnceLock<NodeCgroups> = OnceLock::new();

/// Sets this node's cgroups for the life of the process (the agent, at its start, from its
/// configuration). False when they were set before (or read: [`node`] fixes the defaults).
pub fn configure(cgroups: NodeCgroups) -> bool {
    NODE.set(cgroups).is_ok()
}

/// This node's cgroups: as [`configure`]d, else Nomad's defaults.
pub fn node() -> &'static NodeCgroups {
    NODE.get_or_init(NodeCgroups::default)
}

/// Whose process it is, by its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Whose {
    /// A task of this node's Nomad client: its cgroup is the task's.
    Task { alloc_id: String, task: String },
    /// A docker container (its ID: 64 hex digits).
    Container { id: String },
    /// A process in one of the other simulated nodes' cgroups ([`NodeCgroups::other_nodes`]).
    OtherNode,
    /// None of these: a host process, or one in no cgroup the agent knows.
    Unknown,
}

impl Whose {
    /// The allocation, for a task.
    pub fn alloc_id(&self) -> Option<&str> {
        match self {
            Whose::Task { alloc_id, .. } => Some(alloc_id),
            _ => None,
        }
    }
}

/// Whose process `pid` is, from `/proc/<pid>/cgroup` and `node` (the agent passes [`node`]).
/// Errors: the file cannot be read (ENOENT or ESRCH: the process is gone).
pub fn of_pid(pid: u32, node: &NodeCgroups) -> std::io::Result<Whose> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    Ok(of_cgroup(&text, node))
}

/// Whose process it is, from its `/proc/<pid>/cgroup` text (`<id>:<controllers>:<path>` a
/// line; `0::<path>` for cgroup v2). A process in another node's cgroup is that node's,
/// whatever else its lines say; then the task named by any line; then a container.
pub fn of_cgroup(text: &str, node: &NodeCgroups) -> Whose {
    let lines: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            Some((ctrl, path.trim_start_matches('/')))
        })
        .collect();
    let v2 = lines.iter().find(|(c, _)| c.is_empty()).map(|(_, p)| *p);
    if let Some(p) = v2 {
        if node
            .other_nodes
            .iter()
            .any(|o| p == o || under(p, o).is_some())
        {
            return Whose::OtherNode;
        }
    }
    if let Some(w) = v2.and_then(|p| task_v2(p, &node.parent_v2)) {
        return w;
    }
    for (ctrl, path) in &lines {
        if ctrl.is_empty() {
            continue;
        }
        let ctrls: Vec<&str> = ctrl.split(',').collect();
        let scope = if ctrls.contains(&"cpuset") {
            under(path, &node.parent_v1).and_then(|r| r.strip_prefix("reserve/"))
        } else if ctrls
            .iter()
            .any(|c| ["freezer", "cpu", "memory"].contains(c))
        {
            under(path, &node.parent_v1)
        } else {
            None
        };
        if let Some(w) = scope.and_then(|s| task_scope(s, "")) {
            return w;
        }
    }
    lines
        .iter()
        .find_map(|(_, p)| container(p))
        .unwrap_or(Whose::Unknown)
}

/// `path` below `parent` (component-wise): the rest, without its leading `/`.
fn under<'a>(path: &'a str, parent: &str) -> Option<&'a str> {
    if parent.is_empty() {
        return Some(path);
    }
    path.strip_prefix(parent)?.strip_prefix('/')
}

/// A v2 task cgroup: `<parent>/{share,reserve}.slice/<alloc id>.<task>.scope`, exactly.
fn task_v2(path: &str, parent: &str) -> Option<Whose> {
    let rest = under(path, parent)?;
    let scope = rest
        .strip_prefix("share.slice/")
        .or_else(|| rest.strip_prefix("reserve.slice/"))?;
    task_scope(scope, ".scope")
}

/// `<alloc id>.<task><suffix>` with no `/`: the allocation is a UUID (36 characters), the
/// task the rest (a task's name may hold dots).
fn task_scope(scope: &str, suffix: &str) -> Option<Whose> {
    if scope.contains('/') {
        return None;
    }
    let body = scope.strip_suffix(suffix)?;
    let (alloc, task) = (body.get(..36)?, body.get(36..)?.strip_prefix('.')?);
    (is_uuid(alloc) && !task.is_empty()).then(|| Whose::Task {
        alloc_id: alloc.to_string(),
        task: task.to_string(),
    })
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// A container's cgroup: a last component `docker-<id>.scope`, or `<id>` under `docker/`.
fn container(path: &str) -> Option<Whose> {
    let (dir, last) = path.rsplit_once('/').unwrap_or(("", path));
    let id = last
        .strip_prefix("docker-")
        .and_then(|l| l.strip_suffix(".scope"))
        .or_else(|| (dir == "docker" || dir.ends_with("/docker")).then_some(last))?;
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| Whose::Container { id: id.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0b9a3c2e-1111-4000-8000-000000000002";

    fn task(task: &str) -> Whose {
        Whose::Task {
            alloc_id: A.into(),
            task: task.into(),
        }
    }

    #[test]
    fn a_v2_task_scope_names_its_allocation_and_task() {
        let n = NodeCgroups::default();
        let t = format!("0::/nomad.slice/share.slice/{A}.app.v2.scope\n");
        assert_eq!(of_cgroup(&t, &n), task("app.v2"));
        let r = format!("0::/nomad.slice/reserve.slice/{A}.db.scope\n");
        assert_eq!(of_cgroup(&r, &n), task("db"));
        // Below the scope, beside it, or without `.scope`: not Nomad's.
        for path in [
            format!("/nomad.slice/share.slice/{A}.app.scope/x"),
            format!("/nomad.slice/{A}.app.scope"),
            format!("/nomad.slice/share.slice/{A}.app"),
            format!("/other.slice/share.slice/{A}.app.scope"),
            "/nomad.slice/share.slice/not-a-uuid.app.scope".into(),
            "/user.slice/user-0.slice/session-1.scope".into(),
        ] {
            assert_eq!(
                of_cgroup(&format!("0::{path}\n"), &n),
                Whose::Unknown,
                "{path}"
            );
        }
    }

    #[test]
    fn v1_hierarchies_name_the_task_as_nomads_cgroup_v1_paths() {
        let n = NodeCgroups::default();
        let t = format!(
            "12:pids:/\n11:freezer:/nomad/{A}.app\n4:cpu,cpuacct:/nomad/{A}.app\n1:name=systemd:/system.slice/nomad.service\n0::/system.slice/nomad.service\n"
        );
        assert_eq!(of_cgroup(&t, &n), task("app"));
        let cpuset = format!("3:cpuset:/nomad/reserve/{A}.app\n");
        assert_eq!(of_cgroup(&cpuset, &n), task("app"));
        // The shared cpuset partition holds every task's processes: it names none.
        assert_eq!(of_cgroup("3:cpuset:/nomad/share\n", &n), Whose::Unknown);
        // A controller Nomad does not make a task cgroup in.
        let pids = format!("12:pids:/nomad/{A}.app\n");
        assert_eq!(of_cgroup(&pids, &n), Whose::Unknown);
    }

    #[test]
    fn a_container_is_named_by_its_id() {
        let id = "ab".repeat(32);
        let n = NodeCgroups::default();
        let want = Whose::Container { id: id.clone() };
        assert_eq!(
            of_cgroup(&format!("0::/system.slice/docker-{id}.scope\n"), &n),
            want
        );
        assert_eq!(of_cgroup(&format!("0::/docker/{id}\n"), &n), want);
        assert_eq!(of_cgroup(&format!("5:memory:/docker/{id}\n"), &n), want);
        assert_eq!(
            of_cgroup("0::/system.slice/docker-short.scope\n", &n),
            Whose::Unknown
        );
    }

    #[test]
    fn another_nodes_cgroups_are_that_nodes_and_a_configured_parent_is_used() {
        let mount = std::path::Path::new("/sys/fs/cgroup/unified");
        let n = NodeCgroups::from_settings(
            Some("/sys/fs/cgroup/unified/t/node-1.nomad"),
            &[
                "/sys/fs/cgroup/unified/t/node-2.nomad".into(),
                "t/node-2.agent/".into(),
            ],
            Some(mount),
        );
        assert_eq!(n.parent_v2, "t/node-1.nomad");
        assert_eq!(n.other_nodes, vec!["t/node-2.nomad", "t/node-2.agent"]);
        let mine = format!("0::/t/node-1.nomad/share.slice/{A}.app.scope\n");
        assert_eq!(of_cgroup(&mine, &n), task("app"));
        let theirs = format!("0::/t/node-2.nomad/share.slice/{A}.app.scope\n");
        assert_eq!(of_cgroup(&theirs, &n), Whose::OtherNode);
        assert_eq!(of_cgroup("0::/t/node-2.agent\n", &n), Whose::OtherNode);
        // A name that only starts like another node's cgroup is not below it.
        assert_eq!(of_cgroup("0::/t/node-2.agentx\n", &n), Whose::Unknown);
        // The default parent is not this node's any more.
        let default = format!("0::/nomad.slice/share.slice/{A}.app.scope\n");
        assert_eq!(of_cgroup(&default, &n), Whose::Unknown);
    }
}
