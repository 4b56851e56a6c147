# ACL policy for the dhv-binder system job (least privilege; see README "ACL policy" for what
# remains broad and why, and docs/security.md for the threat model).
#   nomad acl policy apply -namespace default -job dhv-binder dhv-binder jobspecs/dhv-binder-policy.hcl
#
# - read-job in every namespace: the event stream (topic Allocation, namespace=*) and
#   allocation reads (Nomad has no per-node scope for them);
# - host-volume-register / host-volume-read / host-volume-delete: the placeholder host
#   volumes each node offers for deferred volumes (Nomad cannot scope these to one node or
#   one path);
# - alloc-lifecycle: restart an allocation whose published FUSE mount died and was
#   published again (the tasks get a fresh bind of the new mount);
# - variables: the volume records (read, list; write to report create/delete progress;
#   destroy after a signed delete), the single-node claims (locks) and the snapshot records
#   (issue 14: a node reports a snapshot's progress and removes a deleted one), nothing else
#   under dhv-binder/ and nothing outside it. Records are verified against operator keys on each
#   node, so this write access cannot steer what a node mounts or deletes;
# - in namespace "default" only, also this node's record (dhv-binder/nodes/<node-id>, read by
#   `node status`, `plugin status` and `volume create`'s fail-fast check), and the record
#   change marker dhv-binder/records-changed (read: every agent follows it with a blocking
#   read; write: a node that writes a record back updates it; docs/scale.md "The change
#   marker"; without it agents list the records every 10 s). Nomad applies the
#   rule of an exact namespace match instead of a glob's (acl/acl.go), so the "default" block
#   repeats every capability of the "*" block: keep the two in step;
# - node read: the node's allocation list; agent read: the local node ID.
namespace "*" {
  capabilities = ["read-job", "alloc-lifecycle", "host-volume-register", "host-volume-read", "host-volume-delete"]

  variables {
    path "dhv-binder/volumes/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/claims/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/snapshots/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
  }
}

namespace "default" {
  capabilities = ["read-job", "alloc-lifecycle", "host-volume-register", "host-volume-read", "host-volume-delete"]

  variables {
    path "dhv-binder/volumes/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/claims/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/snapshots/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/nodes/*" {
      capabilities = ["read", "write"]
    }
    path "dhv-binder/records-changed" {
      capabilities = ["read", "write"]
    }
  }
}

node {
  policy = "read"
}

agent {
  policy = "read"
}
