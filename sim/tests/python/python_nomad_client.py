"""A third-party Nomad client (python-nomad, PyPI) against nomad-sim.

Run by sim/tests/python_nomad.rs with NOMAD_ADDR, SIM_MANAGEMENT_TOKEN, NODE1, NODE2 (node
IDs) in the environment. Exercises every python-nomad call whose endpoint the simulator serves
and checks what the answers mean, not only that they parse. Exits non-zero on the first failure.
"""

import os
import queue
import sys
import time

try:
    import nomad
    import nomad.api.exceptions as exc
except ImportError as e:  # never skip: the test must fail and say why
    sys.exit(f"python-nomad is not importable ({e}): run scripts/install-deps")

ADDR = os.environ["NOMAD_ADDR"]
TOKEN = os.environ["SIM_MANAGEMENT_TOKEN"]
NODE1, NODE2 = os.environ["NODE1"], os.environ["NODE2"]

n = nomad.Nomad(address=ADDR, token=TOKEN, timeout=10)
done = []


def step(name):
    done.append(name)
    print(f"ok  {name}", flush=True)


def expect(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return e
    raise AssertionError(f"{fn.__qualname__}{args} did not raise {exc_type.__name__}")


def wait_for(what, fn, secs=20):
    deadline = time.time() + secs
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# --------------------------------------------------------------------------- agent, status
agent = n.agent.get_agent()
assert agent["config"]["Region"] == "global", agent["config"]
assert agent["config"]["Server"]["Enabled"] is True
step("agent.get_agent  GET /v1/agent/self")
assert n.status.leader.get_leader() == "127.0.0.1:4647"
step("status.leader.get_leader  GET /v1/status/leader")
assert "default" in [ns["Name"] for ns in n.namespaces.get_namespaces()]
step("namespaces.get_namespaces  GET /v1/namespaces")

# --------------------------------------------------------------------------- nodes
nodes = n.nodes.get_nodes()
assert {x["ID"] for x in nodes} == {NODE1, NODE2}, nodes
assert all(x["Status"] == "ready" for x in nodes), nodes
assert "node-1" in n.nodes and NODE2 in n.nodes and "nope" not in n.nodes
step("nodes.get_nodes  GET /v1/nodes")
node = n.node.get_node(NODE1)
assert node["Name"] == "node-1" and node["SchedulingEligibility"] == "eligible", node
assert "HostVolumes" in node and "Drain" in node
expect(exc.URLNotFoundNomadException, n.node.get_node, "00000000-0000-0000-0000-000000000000")
step("node.get_node  GET /v1/node/:id (200, 404)")

# --------------------------------------------------------------------------- event stream
stream, stream_exit, events = n.event.stream.get_stream(index=0, topic=["Job", "Allocation"])
stream.daemon = True
stream.start()

# --------------------------------------------------------------------------- jobs
HCL = """
job "py" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["1000"]
      }
    }
  }
}
"""
job = n.jobs.parse(HCL, canonicalize=True)
assert job["ID"] == "py" and job["Namespace"] == "default" and job["Type"] == "service", job
assert job["TaskGroups"][0]["Tasks"][0]["Driver"] == "raw_exec"
expect(exc.BadRequestNomadException, n.jobs.parse, "job {")
step("jobs.parse  POST /v1/jobs/parse (200, 400)")
reg = n.jobs.register_job({"Job": job})
assert reg["EvalID"] and reg["JobModifyIndex"] > 0, reg
step("jobs.register_job  POST /v1/jobs")
reg2 = n.job.register_job("py", {"Job": job})
assert reg2["EvalID"], reg2
step("job.register_job  POST /v1/job/:id")
assert "py" in n.jobs and "nope" not in n.jobs
assert [j["ID"] for j in n.jobs.get_jobs(prefix="p")] == ["py"]
step("jobs.get_jobs  GET /v1/jobs")
j = n.job.get_job("py")
assert j["ID"] == "py" and j["TaskGroups"][0]["Name"] == "g", j
expect(exc.URLNotFoundNomadException, n.job.get_job, "nope")
step("job.get_job  GET /v1/job/:id (200, 404)")

allocs = wait_for(
    "alloc running",
    lambda: [a for a in n.job.get_allocations("py") if a["ClientStatus"] == "running"],
)
alloc_id = allocs[0]["ID"]
step("job.get_allocations  GET /v1/job/:id/allocations")
assert alloc_id in [a["ID"] for a in n.allocations.get_allocations()]
assert [a["ID"] for a in n.allocations.get_allocations(prefix=alloc_id[:8])] == [alloc_id]
step("allocations.get_allocations  GET /v1/allocations")
full = n.allocation.get_allocation(alloc_id)
assert full["Job"]["ID"] == "py" and full["TaskStates"]["t"]["State"] == "running", full
expect(exc.URLNotFoundNomadException, n.allocation.get_allocation, "0000dead-0000-0000-0000-000000000000")
step("allocation.get_allocation  GET /v1/allocation/:id (200, 404)")
on_node = n.node.get_allocations(full["NodeID"])
assert alloc_id in [a["ID"] for a in on_node] and on_node[0]["Job"]["ID"] == "py"
step("node.get_allocations  GET /v1/node/:id/allocations")

# --------------------------------------------------------------------------- alloc lifecycle
n.client.allocation.restart_allocation(alloc_id)
wait_for(
    "task restarted",
    lambda: n.allocation.get_allocation(alloc_id)["TaskStates"]["t"]["Restarts"] >= 1
    and n.allocation.get_allocation(alloc_id)["TaskStates"]["t"]["State"] == "running",
)
step("client.allocation.restart_allocation  POST /v1/client/allocation/:id/restart")
stopped = n.allocation.stop_allocation(alloc_id)
assert stopped["EvalID"], stopped
wait_for(
    "replacement running",
    lambda: [
        a
        for a in n.job.get_allocations("py")
        if a["ID"] != alloc_id and a["ClientStatus"] == "running"
    ],
)
old = wait_for(
    "old alloc complete",
    lambda: (lambda a: a if a["ClientStatus"] == "complete" else None)(
        n.allocation.get_allocation(alloc_id)
    ),
)
assert old["DesiredStatus"] == "stop" and old["DesiredTransition"]["Migrate"] is True, old
step("allocation.stop_allocation  POST /v1/allocation/:id/stop")
assert n.system.initiate_garbage_collection()
expect(exc.URLNotFoundNomadException, n.allocation.get_allocation, alloc_id)
assert "py" in n.jobs, "a running job is not collected"
step("system.initiate_garbage_collection  PUT /v1/system/gc (the stopped alloc deleted)")

# --------------------------------------------------------------------------- node eligibility, drain
r = n.node.eligible_node(NODE2, ineligible=True)
assert r["NodeModifyIndex"] > 0, r
assert n.node.get_node(NODE2)["SchedulingEligibility"] == "ineligible"
n.node.eligible_node(NODE2, eligible=True)
assert n.node.get_node(NODE2)["SchedulingEligibility"] == "eligible"
step("node.eligible_node  POST /v1/node/:id/eligibility")
running = [a for a in n.job.get_allocations("py") if a["ClientStatus"] == "running"][0]
src = running["NodeID"]
dst = NODE2 if src == NODE1 else NODE1
n.node.drain_node_with_spec(src, {"Deadline": 60_000_000_000, "IgnoreSystemJobs": False})
drained = n.node.get_node(src)
assert drained["Drain"] is True and drained["SchedulingEligibility"] == "ineligible", drained
wait_for(
    "alloc migrated off the draining node",
    lambda: [
        a
        for a in n.node.get_allocations(dst)
        if a["JobID"] == "py" and a["ClientStatus"] == "running"
    ],
)
n.node.drain_node_with_spec(src, None, mark_eligible=True)
undrained = n.node.get_node(src)
assert undrained["Drain"] is False and undrained["SchedulingEligibility"] == "eligible", undrained
e = expect(exc.BadRequestNomadException, n.node.drain_node, src, enable=True)
assert "Request body is empty" in e.nomad_resp.text, e.nomad_resp.text
step("node.drain_node_with_spec, node.drain_node  POST /v1/node/:id/drain (200, 400 without body)")

# --------------------------------------------------------------------------- variables
v = n.variable.create_variable("py/one", {"Items": {"a": "1"}}, cas=0)
assert v["Path"] == "py/one" and v["Items"] == {"a": "1"} and v["ModifyIndex"] > 0, v
conflict = expect(
    exc.VariableConflict, n.variable.create_variable, "py/one", {"Items": {"a": "2"}}, cas=0
)
assert conflict.nomad_resp.json()["Items"] == {"a": "1"}, conflict.nomad_resp.text
v2 = n.variable.create_variable("py/one", {"Items": {"a": "2"}}, cas=v["ModifyIndex"])
assert v2["Items"] == {"a": "2"} and v2["ModifyIndex"] > v["ModifyIndex"], v2
step("variable.create_variable  PUT /v1/var/:path (cas=0, 409 conflict, cas=N)")
assert n.variable.get_variable("py/one")["Items"] == {"a": "2"}
assert "py/one" in n.variable and "py/none" not in n.variable
step("variable.get_variable  GET /v1/var/:path (200, 404)")
n.variable.create_variable("py/two", {"Items": {"b": "1"}})
listed = n.variables.get_variables(prefix="py/")
assert [x["Path"] for x in listed] == ["py/one", "py/two"], listed
assert "Items" not in listed[0]
step("variables.get_variables  GET /v1/vars?prefix=")
expect(exc.VariableConflict, n.variable.delete_variable, "py/one", cas=1)
assert n.variable.delete_variable("py/one", cas=v2["ModifyIndex"]).ok
assert "py/one" not in n.variable
step("variable.delete_variable  DELETE /v1/var/:path (409 on stale cas, 200)")

# --------------------------------------------------------------------------- ACLs
boot = n.acl.generate_bootstrap()
assert boot["Type"] == "management" and boot["SecretID"], boot
assert nomad.Nomad(address=ADDR, token=boot["SecretID"], timeout=10).acl.get_tokens()
e = expect(exc.BadRequestNomadException, n.acl.generate_bootstrap)
assert "ACL bootstrap already done (reset index: " in e.nomad_resp.text, e.nomad_resp.text
step("acl.generate_bootstrap  POST /v1/acl/bootstrap (200 once, then 400)")
n.acl.create_policy(
    "py-read",
    {"Name": "py-read", "Description": "read jobs", "Rules": 'namespace "default" { policy = "read" }'},
)
assert n.acl.get_policy("py-read")["Rules"].startswith("namespace")
assert "py-read" in [p["Name"] for p in n.acl.get_policies()]
step("acl.create_policy, get_policy, get_policies  /v1/acl/policy/:name, /v1/acl/policies")
tok = n.acl.create_token({"Name": "py", "Type": "client", "Policies": ["py-read"]})
assert tok["Type"] == "client" and tok["Policies"] == ["py-read"] and tok["SecretID"], tok
assert tok["AccessorID"] in [t["AccessorID"] for t in n.acl.get_tokens()]
assert n.acl.get_token(tok["AccessorID"])["SecretID"] == tok["SecretID"]
upd = n.acl.update_token(tok["AccessorID"], {"AccessorID": tok["AccessorID"], "Name": "py2", "Type": "client", "Policies": ["py-read"]})
assert upd["Name"] == "py2", upd
step("acl.create_token, get_tokens, get_token, update_token  /v1/acl/token[s]")
client = nomad.Nomad(address=ADDR, token=tok["SecretID"], timeout=10)
assert client.acl.get_self_token()["AccessorID"] == tok["AccessorID"]
step("acl.get_self_token  GET /v1/acl/token/self")
assert "py" in client.jobs
e = expect(exc.URLNotAuthorizedNomadException, client.jobs.register_job, {"Job": job})
assert e.nomad_resp.text == "Permission denied", e.nomad_resp.text
expect(exc.URLNotAuthorizedNomadException, client.acl.get_tokens)
step("a client token reads jobs, gets 403 Permission denied for writes and ACL admin")
assert n.acl.delete_token(tok["AccessorID"])
expect(exc.URLNotAuthorizedNomadException, client.jobs.get_jobs)
assert n.acl.delete_policy("py-read")
expect(exc.URLNotFoundNomadException, n.acl.get_policy, "py-read")
step("acl.delete_token, delete_policy  DELETE /v1/acl/token/:id, /v1/acl/policy/:name")
anon = nomad.Nomad(address=ADDR, timeout=10)
expect(exc.URLNotAuthorizedNomadException, anon.jobs.get_jobs)
step("no token with ACLs on: 403")

# --------------------------------------------------------------------------- deregister
n.job.deregister_job("py")  # stop
wait_for("job stopped", lambda: n.job.get_job("py")["Stop"] is True)
wait_for(
    "allocs complete",
    lambda: all(a["ClientStatus"] in ("complete", "failed") for a in n.job.get_allocations("py")),
)
step("job.deregister_job  DELETE /v1/job/:id")
n.job.deregister_job("py", purge=True)  # python-nomad sends purge=True (Go ParseBool accepts it)
expect(exc.URLNotFoundNomadException, n.job.get_job, "py")
assert "py" not in n.jobs
# A purge deletes the job and its allocations (DeleteJobTxn -> deleteAllocsForJobTxn).
assert not [a for a in n.allocations.get_allocations() if a["JobID"] == "py"]
step("job.deregister_job(purge=True)  DELETE /v1/job/:id?purge=True deletes its allocations")

# --------------------------------------------------------------------------- event stream content
frames = []
deadline = time.time() + 10
while time.time() < deadline:
    try:
        frames.append(events.get(timeout=0.5))
    except queue.Empty:
        if any(ev["Type"] == "JobDeregistered" and ev["Payload"].get("Deleted") for f in frames for ev in f["Events"]):
            break
stream_exit.set()
evs = [ev for f in frames for ev in f["Events"]]
assert all(set(f) == {"Index", "Events"} for f in frames), frames[:1]
assert all(ev["Index"] == f["Index"] for f in frames for ev in f["Events"])
types = {(ev["Topic"], ev["Type"]) for ev in evs}
for want in [
    ("Job", "JobRegistered"),
    ("Job", "JobDeregistered"),
    ("Allocation", "PlanResult"),
    ("Allocation", "AllocationUpdated"),
    ("Allocation", "AllocationUpdateDesiredStatus"),
]:
    assert want in types, (want, sorted(types))
alloc_evs = [ev for ev in evs if ev["Topic"] == "Allocation"]
assert all("Job" not in ev["Payload"]["Allocation"] for ev in alloc_evs)
assert all(ev["Key"] == ev["Payload"]["Allocation"]["ID"] for ev in alloc_evs)
assert all(ev["FilterKeys"][0] == "py" for ev in alloc_evs)
idx = [f["Index"] for f in frames]
assert idx == sorted(idx), idx
step("event.stream.get_stream  GET /v1/event/stream?index=0&topic=Job&topic=Allocation")

print(f"python-nomad {getattr(nomad, '__version__', '?')}: {len(done)} checks passed", flush=True)
