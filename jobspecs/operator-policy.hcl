# ACL policy for a human operator running the dhv-binder CLI (volume create, delete, status,
# list, snapshot, register/deregister; node status and plugin status). The daemon's own policy
# is jobspecs/dhv-binder-policy.hcl.
#   nomad acl policy apply -description "dhv-binder operator" dhv-binder-operator jobspecs/operator-policy.hcl
#   nomad acl token create -name alice -policy dhv-binder-operator
#
# - variables dhv-binder/volumes/*: the volume records (create and delete write a signed
#   request, deregister destroys it; status and list read them);
# - variables dhv-binder/snapshots/*: `volume snapshot create/list/delete`;
# - variables dhv-binder/claims/* (read): who holds a single-node volume, for `volume status`;
# - variables dhv-binder/nodes/* (read, namespace "default" only): the agents' node records,
#   read by `volume create`'s fail-fast check, `volume status`, `node status`, `plugin status`;
# - variable dhv-binder/records-changed (read, write; namespace "default" only): the change
#   marker each record write updates, so that agents read the new record at once (without
#   it the command warns and agents see the record at their next relist, within 5 min);
# - variables dhv-binder/unpublish-requests/* (read, list, write): `volume unpublish -force`
#   writes its signed request there and reads the node's answer;
# - host-volume-read: the placeholder host volumes shown by `volume status`;
# - read-job and node read: the allocations using a volume, node names and status.
# Replace "default" with the operator's namespaces (one block each; Nomad applies an exact
# namespace match instead of a glob's, acl/acl.go); keep the nodes/* and records-changed paths
# in "default".
namespace "default" {
  capabilities = ["read-job", "host-volume-read"]

  variables {
    path "dhv-binder/volumes/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/snapshots/*" {
      capabilities = ["read", "list", "write", "destroy"]
    }
    path "dhv-binder/claims/*" {
      capabilities = ["read", "list"]
    }
    path "dhv-binder/nodes/*" {
      capabilities = ["read", "list"]
    }
    path "dhv-binder/records-changed" {
      capabilities = ["read", "write"]
    }
    path "dhv-binder/unpublish-requests/*" {
      capabilities = ["read", "list", "write"]
    }
  }
}

node {
  policy = "read"
}
