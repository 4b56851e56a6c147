# dhv-binder: the per-node daemon, as a Nomad system job (one allocation on every client).
#
# The task fetches a release (binary plus the reference plugins) through an `artifact`
# block, checked against its SHA-256; see docs/operations/installing.md ("Packaging").
#
# Before running it:
# 1. Set `release_url` and `release_sha256` below (or pass -var) to the release you host
#    (`scripts/release` builds it). The daemon uses the plugins shipped in the release;
#    to use site plugins instead, point DHV_BINDER_PLUGIN_DIR at a client directory such as
#    /opt/dhv-binder/plugins.
# 2. Give every client the static host volume that carries the daemon's socket to prestart
#    tasks. Its directory must exist before the Nomad client starts (a missing static
#    host_volume path stops the client), so it lives on persistent storage, not on tmpfs:
#      install -d -m 0755 /var/lib/dhv-binder/socket
#    and in the client agent configuration:
#      client {
#        host_volume "dhv-binder-socket" {
#          path      = "/var/lib/dhv-binder/socket"
#          read_only = true
#        }
#      }
# 3. Attach the policy to this job's workload identity:
#      nomad acl policy apply -namespace default -job dhv-binder dhv-binder jobspecs/dhv-binder-policy.hcl
#
# The daemon talks to its local Nomad agent through the Task API socket
# (${NOMAD_SECRETS_DIR}/api.sock), authenticated by this task's workload identity: no
# address, CA or client certificate to configure, with or without mTLS. To use TCP instead,
# set NOMAD_ADDR (and NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY) in the env block.

variable "release_url" {
  description = "URL of the release archive (dhv-binder_<version>_linux_<arch>.tar.gz)"
  type        = string
  default     = "https://releases.example.com/dhv-binder/0.1.0/dhv-binder_0.1.0_linux_amd64.tar.gz"
}

variable "release_sha256" {
  description = "SHA-256 of that archive (from its SHA256SUMS)"
  type        = string
  default     = "0000000000000000000000000000000000000000000000000000000000000000"
}

job "dhv-binder" {
  type        = "system"
  namespace   = "default"
  datacenters = ["*"]
  node_pool   = "all"
  # Above ordinary jobs (default 50): with the system scheduler's preemption on (Nomad's
  # default), a node short of resources makes room for the daemon by preempting
  # allocations at least 10 priority points lower, instead of leaving it unplaced.
  priority = 90

  # An update (a new release) replaces the allocation one node at a time, the next node
  # `stagger` later (Nomad 1.10 `scheduler/scheduler_system.go` `computeJobAllocs`,
  # `evictAndPlace`; from 1.11 also after the batch is healthy). On each
  # node the old agent's cgroup is killed; published volumes stay mounted and their FUSE
  # helpers keep serving them from their own cgroups; the new agent reads the journal and
  # adopts them (docs/operations/upgrades.md, "Upgrades, helper cgroups and memory").
  # One node's agent is replaced at a time. Nomad 1.10 paces the batches with `stagger`
  # (scheduler/scheduler_system.go); from Nomad 1.11 a system job's update is a deployment:
  # the next node waits until this one's agent has run for `min_healthy_time` (default 10s)
  # and `stagger` is unused. docs/operations/upgrades.md, "Upgrading the system job".
  update {
    max_parallel = 1
    stagger      = "15s"
  }

  group "agent" {
    # The daemon must outlive the allocations it serves during a drain.
    restart {
      attempts = 10
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    # Metrics for Prometheus: registered in Nomad's service catalogue (Prometheus's
    # `nomad_sd_configs` discovers `dhv-binder-metrics`). The endpoint has no
    # authentication, so it stays on the node's loopback (DHV_BINDER_METRICS_ADDR below):
    # scrape it with a Prometheus agent on each node, or bind it to a protected network
    # and change `address` with it.
    network {
      port "metrics" {
        static = 9464
      }
    }

    service {
      provider = "nomad"
      name     = "dhv-binder-metrics"
      port     = "metrics"
      address  = "127.0.0.1"
      tags     = ["metrics"]
    }

    task "agent" {
      # raw_exec: the daemon mounts volumes in the host's mount namespace, where Nomad's
      # bind mounts into tasks find them. Enable raw_exec on the clients for this job.
      driver = "raw_exec"

      # The release unpacks to local/dhv-binder/{dhv-binder,plugins/}. go-getter checks the
      # archive against the checksum before unpacking; a mismatch fails the task.
      artifact {
        source      = var.release_url
        destination = "local/"
        options {
          checksum = "sha256:${var.release_sha256}"
        }
      }

      config {
        command = "local/dhv-binder/dhv-binder"
        args    = ["agent"]
      }

      # The workload identity token is the daemon's Nomad token (policy attached above).
      identity {
        env = true
      }

      env {
        NOMAD_ADDR             = "unix://${NOMAD_SECRETS_DIR}/api.sock"
        DHV_BINDER_STATE_DIR   = "/var/lib/dhv-binder"
        DHV_BINDER_SOCKET      = "/var/lib/dhv-binder/socket/api.sock"
        DHV_BINDER_PLUGIN_DIR  = "${NOMAD_TASK_DIR}/dhv-binder/plugins"
        # Where each plugin may keep storage, <plugin_id>=<dir>, ','-separated (bind's
        # export, ext4's images); a path in a volume record outside these and the volumes dir
        # is refused by the plugin (docs/security.md).
        DHV_BINDER_PLUGIN_ROOTS = "bind=/srv/dhv-exports"
        # The servers' HTTP addresses, for claim renewals while the local client agent
        # restarts (its socket is gone meanwhile; docs/operations/claims.md, "Restarting the local
        # Nomad client"). Same token and TLS settings as NOMAD_ADDR.
        # DHV_BINDER_FALLBACK_ADDRESSES = "https://nomad-server-1:4646,https://nomad-server-2:4646"
        DHV_BINDER_LOG         = "info"
        DHV_BINDER_LOG_FORMAT  = "json"
        # Prometheus metrics on the node's loopback only (unset to turn them off), at the
        # service's port.
        DHV_BINDER_METRICS_ADDR = "127.0.0.1:${NOMAD_PORT_metrics}"
        # Operators' public keys (docs/security.md): root-owned, on each node, never in Nomad.
        DHV_BINDER_RECORD_KEYS = "/etc/dhv-binder/record-keys.pub"
        # Plugins' long-lived helpers run in a cgroup per volume under
        # <cgroup2 mount>/dhv-binder.slice, outside this task's cgroup, each with its own
        # memory.max (docs/operations/upgrades.md, "Upgrades, helper cgroups and memory").
        DHV_BINDER_HELPER_CGROUP = "auto"
        DHV_BINDER_HELPER_MEMORY_MAX = "512MiB"
      }

      # Nomad kills this task's whole cgroup when it stops (an update, a drain, a restart).
      # Published volumes stay mounted through it: the mounts live in the host's mount
      # namespace, and plugins run their long-lived helpers (the webdav plugin's rclone) in
      # per-volume cgroups outside this one, under DHV_BINDER_HELPER_CGROUP; the next agent
      # adopts them, and a plugin call cut short is resolved from the journal on start.
      # Nomad caps kill_timeout at the client's max_kill_timeout (default 30s).
      kill_timeout = "30s"

      # The agent's own memory: plugin helpers are accounted in their helper cgroups
      # (DHV_BINDER_HELPER_MEMORY_MAX each); short plugin calls (mkfs, resize2fs) run here.
      # `cpu` is also the weight of this task's cgroup when the node's CPUs are saturated
      # (cgroups v1 cpu.shares; v2 cpu.weight derived from it): well above the tasks' own, so
      # that claim renewals are not starved by the tasks they protect (the renewal thread
      # also runs at nice -10 within this cgroup; docs/operations/claims.md "A loaded node").
      resources {
        cpu    = 1000
        memory = 128
      }
    }
  }
}
