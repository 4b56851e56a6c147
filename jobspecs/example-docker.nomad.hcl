# The example job for the docker driver. The prestart task needs no dhv-binder binary:
# it calls the daemon's socket with curl and the task's workload identity token.
# It uses only what the official curl image (curlimages/curl, built by curl/curl-container:
# Alpine with busybox /bin/sh, curl built from source, runs as the unprivileged curl_user)
# has: /bin/sh, curl's --unix-socket, --fail-with-body (curl 7.76+), --retry-connrefused;
# the daemon's socket is mode 0666, so curl_user may connect to it.
job "shared-data-demo-docker" {
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

    volume "dhv-binder" {
      type      = "host"
      source    = "dhv-binder-socket"
      read_only = true
    }

    task "publish-volumes" {
      lifecycle {
        hook    = "prestart"
        sidecar = false
      }

      driver = "docker"

      config {
        image      = "curlimages/curl:8.11.1"
        entrypoint = ["/bin/sh", "-c"]
        # Retries while dhv-binder answers 503/504 (starting, plugin busy) or its socket is not
        # up yet; fails at once on 4xx (wrong allocation, refused token).
        # The token never is on a command line: the shell's builtin printf writes the header to
        # curl's stdin, which `-H @-` reads (curl 7.55+).
        args = [<<-EOT
          printf 'Authorization: Bearer %s\n' "$NOMAD_TOKEN" |
          curl --silent --show-error --fail-with-body --max-time 130 \
            --retry 20 --retry-delay 3 --retry-connrefused \
            --unix-socket /run/dhv-binder/api.sock \
            -X POST -H @- \
            "http://dhv-binder/v1/allocations/$NOMAD_ALLOC_ID/publish?wait=2m"
        EOT
        ]
      }

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
      driver = "docker"

      config {
        image   = "busybox:1.37"
        command = "/bin/sh"
        args    = ["-c", "echo hello from $NOMAD_ALLOC_ID >> /data/greetings.txt && exec sleep 3600"]
      }

      volume_mount {
        volume      = "data"
        destination = "/data"
      }

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
