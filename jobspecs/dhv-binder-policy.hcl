# ACL policy for the dhv-binder system job (least privilege).
#   nomad acl policy apply -namespace default -job dhv-binder dhv-binder jobspecs/dhv-binder-policy.hcl
#
# - read-job in every namespace: the event stream (topic Allocation, namespace=*) and
#   allocation reads;
# - host-volume-register / host-volume-read / host-volume-delete: the placeholder host
#   volumes each node offers for deferred volumes;
# - alloc-lifecycle: restart an allocation whose published FUSE mount died and was
#   published again (the tasks get a fresh bind of the new mount);
# - variables under dhv-binder/: the cluster-wide volume records;
# - node read: the node's allocation list; agent read: the local node ID.
namespace "*" {
  capabilities = ["read-job", "alloc-lifecycle", "host-volume-register", "host-volume-read", "host-volume-delete"]

  variables {
    path "dhv-binder/*" {
      capabilities = ["read", "write", "list", "destroy"]
    }
  }
}

node {
  policy = "read"
}

agent {
  policy = "read"
}
