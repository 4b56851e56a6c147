# dhv-binder: the per-node daemon, as a Nomad system job (one allocation on every client).
#
# Before running it:
# 1. Install the binary on every client as /usr/local/bin/dhv-binder and put volume plugins in
#    /opt/dhv-binder/plugins (see plugins/).
# 2. Give every client the static host volume that carries the daemon's socket to prestart
#    tasks (client agent configuration):
#      client {
#        host_volume "dhv-binder-socket" {
#          path      = "/run/dhv-binder"
#          read_only = true
#        }
#      }
# 3. Attach the policy to this job's workload identity:
#      nomad acl policy apply -namespace default -job dhv-binder dhv-binder jobspecs/dhv-binder-policy.hcl
job "dhv-binder" {
  type        = "system"
  namespace   = "default"
  datacenters = ["*"]
  node_pool   = "all"

  group "agent" {
    # The daemon must outlive the allocations it serves during a drain.
    restart {
      attempts = 10
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    task "agent" {
      # raw_exec: the daemon mounts volumes in the host's mount namespace, where Nomad's
      # bind mounts into tasks find them. Enable raw_exec on the clients for this job.
      driver = "raw_exec"

      config {
        command = "/usr/local/bin/dhv-binder"
        args    = ["agent"]
      }

      # The workload identity token is the daemon's Nomad token (policy attached above).
      identity {
        env = true
      }

      env {
        NOMAD_ADDR             = "http://127.0.0.1:4646"
        DHV_BINDER_STATE_DIR   = "/var/lib/dhv-binder"
        DHV_BINDER_SOCKET      = "/run/dhv-binder/api.sock"
        DHV_BINDER_PLUGIN_DIR  = "/opt/dhv-binder/plugins"
        # Where plugins may keep storage (bind's export, ext4's images), ':'-separated; a
        # path in a volume record outside these and the volumes dir is refused.
        DHV_BINDER_STORAGE_ROOTS = "/srv/dhv-exports"
        DHV_BINDER_LOG         = "info"
      }

      # Published volumes stay mounted while the daemon restarts or upgrades; a plugin call
      # cut short is resolved from the journal on start. Nomad caps kill_timeout at the
      # client's max_kill_timeout (default 30s).
      kill_timeout = "30s"

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
