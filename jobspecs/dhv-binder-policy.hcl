# ACL policy for the dhv-binder system job: least privilege, for the namespaces it serves.
#   nomad acl policy apply -namespace default -job dhv-binder dhv-binder jobspecs/dhv-binder-policy.hcl
#
# Every Nomad call the agent makes, and what it needs (src/nomad/mod.rs, one function per
# call; tests/jobspecs.rs checks this file, tests/policy.rs runs the agent under it):
# - node read: the node, and its allocation list (GET /v1/node/:id/allocations, the default
#   --watch-mode poll; Nomad lists only the allocations of namespaces the token has read-job
#   in: nomad/node_endpoint.go GetAllocs); agent read: the local node ID;
# - in each namespace it serves volumes in (here "default"; copy the block below for each
#   other one, without the nodes path), and nowhere else:
#   - read-job: the allocations placed on its node that may use the namespace's volumes
#     (GET /v1/allocation/:id);
#   - host-volume-register, host-volume-read, host-volume-delete: the placeholder host
#     volumes of that namespace's deferred volumes (PUT /v1/volume/host/register, GET
#     /v1/volumes, DELETE /v1/volume/host/:id; Nomad cannot scope these to one node or path);
#   - alloc-lifecycle: restart an allocation whose published FUSE mount died and was
#     published again (PUT /v1/client/allocation/:id/restart);
#   - variables: the volume records (read, list; write to report create/delete progress;
#     destroy after a signed delete), the single-node claims (locks: write; destroy on
#     release), the snapshot records (progress; destroy after a signed delete) and the
#     operators' forced-unpublish requests (read, list; write: the node's answer); nothing
#     else under dhv-binder/ (the record watches list namespace=*, which Nomad filters to
#     what the token may list);
#   - variables: read (no list, no write) under the agent's --secrets-path (default
#     dhv-binder-secrets/): the secrets volumes reference with `secret_ref`, read at each
#     plugin call (docs/security.md "Secrets"); nothing else outside dhv-binder/;
#   - in "default" only, also this node's record (dhv-binder/nodes/<node-id>: read, write)
#     and the record change marker dhv-binder/records-changed (read: every agent follows it
#     with a blocking read; write: a node that writes a record back updates it; docs/scale.md
#     "The change marker"; without it agents list the records every 10 s).
# A job in another namespace cannot use these volumes anyway (host volumes are namespaced),
# so the agent need not see its allocations.
#
# What a holder of this token (or anyone who may write the variables of a served namespace)
# can and cannot do, with signed records (docs/security.md "Threat model"):
# - cannot make a node mount, create, copy or delete storage the operator did not sign:
#   every spec, parameter, secret, registered context and delete is signed with the
#   operator's key (kept off the cluster), a delete is bound to the exact record it deletes,
#   and a node takes no storage path from unsigned fields;
# - can, in the namespaces this policy names: rewrite the unsigned fields nodes write back
#   (state short of an acted-on delete, a created volume's context, which plugins refuse
#   unless it names the volume's own storage, sizes, errors), write back an older signed
#   version of a record (its own storage, or nothing), delete records, claims and placeholder
#   host volumes, hold or release claims, restart or stop allocations, register a host volume
#   at any path on any node (Nomad cannot scope host-volume-register): denial of service,
#   and jobs of that namespace mounting what such a volume names; forge node records in
#   "default" that mislead `node status` and `volume create`;
# - can read the jobs and allocations of those namespaces (read-job), environment values in
#   job specs included, and every node; the secrets under dhv-binder-secrets/ of those
#   namespaces (read only); no other variables outside dhv-binder/.
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
    path "dhv-binder/unpublish-requests/*" {
      capabilities = ["read", "list", "write"]
    }
    path "dhv-binder/nodes/*" {
      capabilities = ["read", "write"]
    }
    path "dhv-binder/records-changed" {
      capabilities = ["read", "write"]
    }
    path "dhv-binder-secrets/*" {
      capabilities = ["read"]
    }
  }
}

# Another namespace whose volumes this daemon serves (uncomment, rename, one per namespace):
# namespace "prod" {
#   capabilities = ["read-job", "alloc-lifecycle", "host-volume-register", "host-volume-read", "host-volume-delete"]
#
#   variables {
#     path "dhv-binder/volumes/*" {
#       capabilities = ["read", "list", "write", "destroy"]
#     }
#     path "dhv-binder/claims/*" {
#       capabilities = ["read", "list", "write", "destroy"]
#     }
#     path "dhv-binder/snapshots/*" {
#       capabilities = ["read", "list", "write", "destroy"]
#     }
#     path "dhv-binder/unpublish-requests/*" {
#       capabilities = ["read", "list", "write"]
#     }
#     path "dhv-binder-secrets/*" {
#       capabilities = ["read"]
#     }
#   }
# }

# With --watch-mode stream only: the allocation event stream subscribes with namespace=*,
# which Nomad allows only with read-job in every namespace (nomad/event_endpoint.go
# validateACL). Uncomment this block for it (and the agent then reads every job's
# allocations on its node):
# namespace "*" {
#   capabilities = ["read-job"]
# }

node {
  policy = "read"
}

agent {
  policy = "read"
}
