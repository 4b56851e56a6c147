# An example job that uses the deferred volume "shared-data" (exec driver).
#
# The prestart task asks this node's dhv-binder to publish the allocation's deferred
# volumes and exits 0 only when they are mounted; Nomad starts the main task after it, and
# bind-mounts the (now published) placeholder path into it.
job "shared-data-demo" {
  type        = "service"
  datacenters = ["*"]

  group "app" {
    count = 1

    # Nomad's own fence: a client cut off from the servers stops this group 25 s after its
    # last heartbeat: after the longest heartbeat interval (dhv-binder's
    # --heartbeat-interval-max, 20 s, plus 5 s) and before another node may take the
    # single-node volume (--claim-ttl + --claim-lock-delay, 30 s). Without it the agent
    # warns `unfenced` (docs/operations/claims.md, "Claims"); change it with those flags.
    disconnect {
      stop_on_client_after = "25s"
    }

    volume "data" {
      type            = "host"
      source          = "shared-data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }

    # The daemon's socket, offered by every client as a static host volume.
    volume "dhv-binder" {
      type      = "host"
      source    = "dhv-binder-socket"
      read_only = true
    }

    restart {
      attempts = 3
      interval = "5m"
      delay    = "5s"
      mode     = "fail"
    }

    task "publish-volumes" {
      lifecycle {
        hook    = "prestart"
        sidecar = false
      }

      driver = "exec"

      config {
        command = "/usr/local/bin/dhv-binder"
        args    = ["prestart", "--timeout", "2m"]
      }

      # The task's workload identity proves to dhv-binder which allocation it is.
      identity {
        env = true
      }

      volume_mount {
        volume      = "dhv-binder"
        destination = "/run/dhv-binder"
        read_only   = true
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }

    task "app" {
      driver = "exec"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          set -e
          mountpoint -q /data || { echo "/data is not a mount point: the volume was not published" >&2; exit 1; }
          echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) written by allocation $NOMAD_ALLOC_ID" >> /data/greetings.txt
          echo "contents of /data/greetings.txt:"
          cat /data/greetings.txt
          trap 'exit 0' INT TERM
          while true; do sleep 1; done
        EOT
        ]
      }

      volume_mount {
        volume      = "data"
        destination = "/data"
      }

      kill_timeout = "5s"

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
