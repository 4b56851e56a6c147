//! Typed configuration: Nomad connection settings (the Nomad CLI's environment variables)
//! and the agent's own settings, validated before anything binds.

use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach Nomad. Same variables and defaults as the `nomad` CLI.
#[derive(Debug, Clone, Args)]
pub struct NomadConfig {
    /// Nomad agent address. On a client node, the local agent.
    #[arg(
        long = "address",
        env = "NOMAD_ADDR",
        default_value = "http://127.0.0.1:4646",
        global = true
    )]
    pub address: String,
    /// ACL token (sent as X-Nomad-Token). Never logged.
    #[arg(
        long = "token",
        env = "NOMAD_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
    /// Region to send requests to.
    #[arg(long = "region", env = "NOMAD_REGION", global = true)]
    pub region: Option<String>,
    /// Namespace for volume commands (`*` lists all).
    #[arg(
        long = "namespace",
        env = "NOMAD_NAMESPACE",
        default_value = "default",
        global = true
    )]
    pub namespace: String,
    /// PEM CA certificate to verify Nomad's TLS certificate.
    #[arg(long = "ca-cert", env = "NOMAD_CACERT", global = true)]
    pub ca_cert: Option<PathBuf>,
    /// PEM client certificate for mutual TLS.
    #[arg(long = "client-cert", env = "NOMAD_CLIENT_CERT", global = true)]
    pub client_cert: Option<PathBuf>,
    /// PEM client key for mutual TLS.
    #[arg(long = "client-key", env = "NOMAD_CLIENT_KEY", global = true)]
    pub client_key: Option<PathBuf>,
    /// Do not verify Nomad's TLS certificate (testing only).
    #[arg(long = "tls-skip-verify", env = "NOMAD_SKIP_VERIFY", global = true)]
    pub skip_verify: bool,
}

/// Settings of `dhv-binder agent`.
#[derive(Debug, Clone, Args)]
pub struct AgentConfig {
    /// Directory for the journal and the placeholder mount points (`<state-dir>/mnt/<ns>/<volume>`).
    #[arg(
        long,
        env = "DHV_BINDER_STATE_DIR",
        default_value = "/var/lib/dhv-binder"
    )]
    pub state_dir: PathBuf,
    /// Unix socket of the local API that prestart tasks call.
    #[arg(
        long,
        env = "DHV_BINDER_SOCKET",
        default_value = "/run/dhv-binder/api.sock"
    )]
    pub socket: PathBuf,
    /// Directory of volume plugins (executables named by plugin ID).
    #[arg(
        long,
        env = "DHV_BINDER_PLUGIN_DIR",
        default_value = "/opt/dhv-binder/plugins"
    )]
    pub plugin_dir: PathBuf,
    /// Working directory handed to plugins as DHV_VOLUMES_DIR (default `<state-dir>/volumes`).
    #[arg(long, env = "DHV_BINDER_VOLUMES_DIR")]
    pub volumes_dir: Option<PathBuf>,
    /// Longest a plugin call may run before its process group is killed.
    #[arg(long, env = "DHV_BINDER_PLUGIN_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub plugin_timeout: Duration,
    /// A stream silent (not even a `{}` heartbeat, sent every 30 s) this long is dead: two
    /// missed heartbeats and a late third, detected within 3 heartbeat intervals (B18).
    #[arg(long, env = "DHV_BINDER_STREAM_IDLE_TIMEOUT", default_value = "75s", value_parser = humantime::parse_duration)]
    pub stream_idle_timeout: Duration,
    /// Where the node's allocations come from: `poll` (blocking queries on the node's own
    /// allocation list) or `stream` (the cluster-wide event stream). See docs/scale.md.
    #[arg(long, env = "DHV_BINDER_WATCH_MODE", value_enum, default_value_t = crate::watch::WatchMode::Poll)]
    pub watch_mode: crate::watch::WatchMode,
    /// File holding the Nomad token, re-read at start, on every reconnect and after every
    /// auth failure (for rotated tokens); when readable it replaces NOMAD_TOKEN.
    #[arg(long, env = "DHV_BINDER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Full relist of the node's allocations at least this often, besides every reconnect
    /// (in poll mode: the blocking query's wait).
    #[arg(long, env = "DHV_BINDER_RESYNC_INTERVAL", default_value = "5m", value_parser = humantime::parse_duration)]
    pub resync_interval: Duration,
    /// How often plugins are re-fingerprinted and failed steps are retried.
    #[arg(long, env = "DHV_BINDER_TICK", default_value = "2s", value_parser = humantime::parse_duration)]
    pub tick: Duration,
    /// How often the plugin directory is rescanned and plugins fingerprinted again.
    #[arg(long, env = "DHV_BINDER_PLUGIN_RESCAN", default_value = "15s", value_parser = humantime::parse_duration)]
    pub plugin_rescan: Duration,
    /// How often published mounts are probed (a dead FUSE mount is republished).
    #[arg(long, env = "DHV_BINDER_HEALTH_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub health_interval: Duration,
    /// Plugin calls on different volumes run in parallel up to this bound.
    #[arg(long, env = "DHV_BINDER_MAX_PARALLEL", default_value_t = 8)]
    pub max_parallel: usize,
    /// TTL of the claim lock that keeps single-node volumes on one node; renewed every TTL/3.
    #[arg(long, env = "DHV_BINDER_CLAIM_TTL", default_value = "15s", value_parser = humantime::parse_duration)]
    pub claim_ttl: Duration,
    /// Lock delay after a claim's TTL lapses, before another node may take it.
    #[arg(long, env = "DHV_BINDER_CLAIM_LOCK_DELAY", default_value = "15s", value_parser = humantime::parse_duration)]
    pub claim_lock_delay: Duration,
    /// Extra audiences accepted on workload identity tokens, besides `nomadproject.io`.
    #[arg(long = "audience", env = "DHV_BINDER_AUDIENCES", value_delimiter = ',')]
    pub audiences: Vec<String>,
    /// Directories the node's plugins may keep storage under (exports, image directories),
    /// besides the volumes dir: handed to every plugin call as `DHV_ALLOWED_ROOTS`; a plugin refuses
    /// any path outside them, whatever a volume record says (docs/plugin-protocol.md).
    #[arg(
        long = "storage-root",
        env = "DHV_BINDER_STORAGE_ROOTS",
        value_delimiter = ':'
    )]
    pub storage_roots: Vec<PathBuf>,
}

/// A configuration that cannot work. The CLI exits with code 64 (EX_USAGE).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{what} must be an absolute path, got {path}")]
    NotAbsolute { what: &'static str, path: PathBuf },
    #[error("NOMAD_ADDR must start with http:// or https://, got {0}")]
    BadAddress(String),
    #[error("NOMAD_CLIENT_CERT and NOMAD_CLIENT_KEY must be set together")]
    HalfClientCert,
    #[error("{what} must be greater than zero")]
    Zero { what: &'static str },
}

impl NomadConfig {
    /// Checks the settings without touching the network.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.address.starts_with("http://") || self.address.starts_with("https://")) {
            return Err(ConfigError::BadAddress(self.address.clone()));
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err(ConfigError::HalfClientCert);
        }
        Ok(())
    }
}

impl AgentConfig {
    /// Checks the settings without touching the filesystem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (what, p) in [
            ("--state-dir", &self.state_dir),
            ("--socket", &self.socket),
            ("--plugin-dir", &self.plugin_dir),
        ] {
            if !p.is_absolute() {
                return Err(ConfigError::NotAbsolute {
                    what,
                    path: p.clone(),
                });
            }
        }
        for r in &self.storage_roots {
            if !r.is_absolute() {
                return Err(ConfigError::NotAbsolute {
                    what: "--storage-root",
                    path: r.clone(),
                });
            }
        }
        if let Some(v) = &self.volumes_dir {
            if !v.is_absolute() {
                return Err(ConfigError::NotAbsolute {
                    what: "--volumes-dir",
                    path: v.clone(),
                });
            }
        }
        if self.max_parallel == 0 {
            return Err(ConfigError::Zero {
                what: "--max-parallel",
            });
        }
        for (what, d) in [
            ("--plugin-timeout", self.plugin_timeout),
            ("--tick", self.tick),
            ("--health-interval", self.health_interval),
            ("--stream-idle-timeout", self.stream_idle_timeout),
            ("--claim-ttl", self.claim_ttl),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Zero { what });
            }
        }
        Ok(())
    }

    /// DHV_VOLUMES_DIR for plugins.
    pub fn volumes_dir(&self) -> PathBuf {
        self.volumes_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("volumes"))
    }

    /// `DHV_ALLOWED_ROOTS` for plugins: the volumes dir, then every `--storage-root`.
    pub fn plugin_roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![self.volumes_dir()];
        roots.extend(self.storage_roots.iter().cloned());
        roots
    }

    /// Root of the placeholder mount points.
    pub fn mount_root(&self) -> PathBuf {
        self.state_dir.join("mnt")
    }
}
