# A deferred volume, for `dhv-binder volume create jobspecs/volume.hcl`.
# Shaped like `nomad volume create` specs; `plugin_id` names a plugin in every node's
# dhv-binder plugin directory.
name      = "shared-data"
type      = "host"
namespace = "default"
plugin_id = "bind"

capacity_min = "1GiB"
capacity_max = "2GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

parameters {
  # For the reference "bind" plugin: the directory standing for the storage server's export
  # (it must be under a storage root of every node: agent --plugin-root bind=<dir>).
  export = "/srv/dhv-exports"
  # Owner and mode of the volume's root directory, set when the plugin creates (bind) or
  # formats (ext4) it: the exec driver runs tasks as `nobody` (65534) unless they set `user`.
  uid  = "65534"
  gid  = "65534"
  mode = "0755"
}
