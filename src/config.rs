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
    /// Directory of PEM CA certificates to verify Nomad's TLS certificate: every file in it
    /// (and its subdirectories) must hold at least one certificate. NOMAD_CACERT, when also
    /// set, wins (as Nomad's `go-rootcerts` `LoadCACerts`).
    #[arg(long = "ca-path", env = "NOMAD_CAPATH", global = true)]
    pub ca_path: Option<PathBuf>,
    /// Name to verify Nomad's TLS certificate against (and send as SNI) instead of the host in
    /// NOMAD_ADDR, e.g. `server.global.nomad` when the address is an IP.
    #[arg(long = "tls-server-name", env = "NOMAD_TLS_SERVER_NAME", global = true)]
    pub tls_server_name: Option<String>,
    /// HTTP basic auth for every request to Nomad, `user:password` (or `user`), for an agent
    /// behind an authenticating proxy. Never logged; prefer the variable to the flag (a flag
    /// shows in the process list).
    #[arg(
        long = "http-auth",
        env = "NOMAD_HTTP_AUTH",
        hide_env_values = true,
        global = true
    )]
    pub http_auth: Option<String>,
    /// PEM client certificate for mutual TLS.
    #[arg(long = "client-cert", env = "NOMAD_CLIENT_CERT", global = true)]
    pub client_cert: Option<PathBuf>,
    /// PEM client key for mutual TLS.
    #[arg(long = "client-key", env = "NOMAD_CLIENT_KEY", global = true)]
    pub client_key: Option<PathBuf>,
    /// Do not verify Nomad's TLS certificate (testing only). The value is parsed as the Nomad
    /// CLI parses NOMAD_SKIP_VERIFY (Go's `strconv.ParseBool`: 1 t T TRUE true True, 0 f F
    /// FALSE false False); anything else is refused rather than guessed.
    #[arg(
        long = "tls-skip-verify",
        env = "NOMAD_SKIP_VERIFY",
        global = true,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = go_bool,
        action = clap::ArgAction::Set
    )]
    pub skip_verify: bool,
}

/// Parses a boolean as Go's `strconv.ParseBool` does (Nomad's `api.DefaultConfig` reads
/// NOMAD_SKIP_VERIFY with it). An empty value is false, as an unset variable.
pub fn go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "" | "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        other => Err(format!(
            "{other:?} is not a boolean as Nomad reads it (1, t, T, TRUE, true, True, 0, f, F, FALSE, false, False)"
        )),
    }
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
    /// Unix socket of the local API that prestart tasks call. Its directory is the
    /// `dhv-binder-socket` static host volume: on persistent storage, because a Nomad client
    /// refuses to start when a static host volume's path is missing (after a reboot, tmpfs).
    #[arg(
        long,
        env = "DHV_BINDER_SOCKET",
        default_value = "/var/lib/dhv-binder/socket/api.sock"
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
    #[arg(long, env = "DHV_BINDER_WATCH_MODE", value_enum, default_value_t = WatchMode::Poll)]
    pub watch_mode: WatchMode,
    /// File holding the Nomad token, re-read at start, on every reconnect and after every
    /// auth failure (for rotated tokens); when readable it replaces NOMAD_TOKEN.
    #[arg(long, env = "DHV_BINDER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Full relist of the node's allocations at least this often, besides every reconnect
    /// (in poll mode: the blocking query's wait).
    #[arg(long, env = "DHV_BINDER_RESYNC_INTERVAL", default_value = "5m", value_parser = humantime::parse_duration)]
    pub resync_interval: Duration,
    /// The record watches' safety relist (volume and snapshot records): every record is
    /// listed again this long (plus up to a fifth of it, jitter) after the last full list.
    /// Between lists an agent follows the change marker that every record writer updates
    /// (`dhv-binder/records-changed`, a blocking read of one variable) and reads only the
    /// records it names, so a change reaches every node within about a second; the relist
    /// catches a writer that did not update the marker (an older CLI, `nomad var put`).
    /// While the marker cannot be read (a policy without it) records are listed every 10 s
    /// (docs/records.md "The change marker").
    #[arg(long, env = "DHV_BINDER_RECORD_RELIST", default_value = "5m", value_parser = humantime::parse_duration)]
    pub record_relist: Duration,
    /// Period of the agent's housekeeping round: the mount table is re-read, placeholders
    /// and volume create/delete work are driven again, callers that went away are dropped.
    /// Retries, claim renewals (TTL/3), mount probes and plugin rescans run when due.
    #[arg(long, env = "DHV_BINDER_TICK", default_value = "2s", value_parser = humantime::parse_duration)]
    pub tick: Duration,
    /// How often the plugin directory is rescanned; a plugin is fingerprinted again then
    /// only when its file changed since its last good fingerprint (or that one failed).
    #[arg(long, env = "DHV_BINDER_PLUGIN_RESCAN", default_value = "15s", value_parser = humantime::parse_duration)]
    pub plugin_rescan: Duration,
    /// How often published mounts are probed (a dead FUSE mount is republished).
    #[arg(long, env = "DHV_BINDER_HEALTH_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub health_interval: Duration,
    /// How often every published volume's usage is read by `statfs` of its mount (each
    /// call bounded by 5 s, never two out for one mount; a newly published volume is read
    /// at once).
    #[arg(long, env = "DHV_BINDER_USAGE_INTERVAL", default_value = "60s", value_parser = humantime::parse_duration)]
    pub usage_interval: Duration,
    /// How often a published volume's plugin is asked its `stats` and `health` when it
    /// declares them (a plugin call each, far dearer than a `statfs`: docs/scale.md); a
    /// newly published volume is asked at once. Between calls the last answers stand.
    #[arg(long, env = "DHV_BINDER_CHECK_INTERVAL", default_value = "5m", value_parser = humantime::parse_duration)]
    pub check_interval: Duration,
    /// Plugin calls on different volumes run in parallel up to this bound.
    #[arg(long, env = "DHV_BINDER_MAX_PARALLEL", default_value_t = 8)]
    pub max_parallel: usize,
    /// TTL of the claim lock that keeps single-node volumes on one node; renewed every TTL/3.
    #[arg(long, env = "DHV_BINDER_CLAIM_TTL", default_value = "15s", value_parser = humantime::parse_duration)]
    pub claim_ttl: Duration,
    /// Lock delay after a claim's TTL lapses, before another node may take it.
    #[arg(long, env = "DHV_BINDER_CLAIM_LOCK_DELAY", default_value = "15s", value_parser = humantime::parse_duration)]
    pub claim_lock_delay: Duration,
    /// The longest interval between two heartbeats of a Nomad client of this cluster: the
    /// servers give each client a TTL of `max(min_heartbeat_ttl, nodes /
    /// max_heartbeats_per_second)` plus a random stagger of up to as much again, and the client
    /// heartbeats once per TTL (Nomad: `nomad/heartbeat.go` `resetHeartbeatTimer`; with the
    /// servers' defaults 10 s and 50: 20 s up to 500 nodes, `nodes / 25` seconds above). A
    /// group's `disconnect { stop_on_client_after }` must be longer than this (plus 5 s
    /// for a heartbeat's round trip and a retry), or Nomad stops healthy allocations between two
    /// heartbeats (docs/operations/claims.md, "Claims").
    #[arg(long, env = "DHV_BINDER_HEARTBEAT_INTERVAL_MAX", default_value = "20s", value_parser = humantime::parse_duration)]
    pub heartbeat_interval_max: Duration,
    /// Other Nomad agents' HTTP addresses (servers, `http(s)://host:4646`, comma-separated),
    /// used for claim lock calls (acquire, renew, release) only while the local agent at
    /// NOMAD_ADDR cannot be connected to at all (restarting: its socket or port is gone), so
    /// that held claims are renewed through a local agent restart longer than the fence
    /// margin allows (docs/architecture.md, "Fencing"). Same token and TLS settings as
    /// NOMAD_ADDR. Unset: no fallback; such a restart fences the claims.
    #[arg(
        long = "fallback-address",
        env = "DHV_BINDER_FALLBACK_ADDRESSES",
        value_delimiter = ','
    )]
    pub fallback_addresses: Vec<String>,
    /// How long before a claim's lease ends (TTL + lock delay after the last renewal that
    /// succeeded was sent) the node fences the volume on itself when no renewal succeeded
    /// (docs/architecture.md, "Fencing"). Default: the claim TTL (at most the largest legal
    /// margin). At most the lock delay plus a third of the TTL, so that two renewals can fail
    /// before a fence.
    #[arg(long, env = "DHV_BINDER_CLAIM_FENCE_MARGIN", value_parser = humantime::parse_duration)]
    pub claim_fence_margin: Option<Duration>,
    /// File of the operators' public keys (`ed25519 <base64>` per line): the agent acts only on
    /// volume records signed by one of them (docs/security.md). Keep it on the node, root-owned.
    #[arg(long, env = "DHV_BINDER_RECORD_KEYS")]
    pub record_keys: Option<PathBuf>,
    /// Act on unsigned volume records (test clusters only: anyone who may write variables
    /// under dhv-binder/volumes/ can then make nodes mount and delete as root).
    #[arg(long, env = "DHV_BINDER_ALLOW_UNSIGNED_RECORDS")]
    pub allow_unsigned_records: bool,
    /// A directory a plugin may touch, `<plugin_id>=<dir>`, repeatable: passed to that plugin
    /// as `DHV_ALLOWED_ROOTS` (docs/security.md). Node configuration, never from a record.
    /// Read at start (plugins themselves are picked up live): a new plugin's root takes a
    /// restart of the agent.
    #[arg(
        long = "plugin-root",
        env = "DHV_BINDER_PLUGIN_ROOTS",
        value_delimiter = ','
    )]
    pub plugin_roots: Vec<String>,
    /// The Nomad Variables prefix the volumes' `secret_ref` blocks may name, in each
    /// volume's namespace (read with this agent's token; its ACL policy grants `read` there
    /// and nothing broader, jobspecs/dhv-binder-policy.hcl). A reference elsewhere is refused.
    #[arg(
        long,
        env = "DHV_BINDER_SECRETS_PATH",
        default_value = "dhv-binder-secrets/"
    )]
    pub secrets_path: String,
    /// Vault's address for `secret_ref { vault = … }` (https, or http on loopback only);
    /// unset: no Vault references are read on this node.
    #[arg(long, env = "VAULT_ADDR")]
    pub vault_addr: Option<String>,
    /// The node's Vault token (sent as X-Vault-Token). Never logged.
    #[arg(long, env = "VAULT_TOKEN", hide_env_values = true)]
    pub vault_token: Option<String>,
    /// The attach limit of a plugin on this node, `<plugin_id>=<N>`, repeatable: while N of
    /// its volumes are published here, the node offers none of its other volumes to Nomad's
    /// scheduler (docs/operations/placement.md, "Attach limits"). Overrides the plugin's fingerprint
    /// `max_volumes`.
    #[arg(
        long = "max-volumes",
        env = "DHV_BINDER_MAX_VOLUMES",
        value_delimiter = ','
    )]
    pub max_volumes: Vec<String>,
    /// The issuer (`iss`) workload identity tokens must carry. Unset (or `cluster`): the
    /// cluster's own, learnt with its keys from `GET /.well-known/openid-configuration` (the
    /// servers' `oidc_issuer`; a cluster without one answers 404 and its tokens must carry no
    /// `iss`). A URL: exactly that issuer. `any`: not checked.
    #[arg(long = "token-issuer", env = "DHV_BINDER_TOKEN_ISSUER")]
    pub token_issuer: Option<String>,
    /// Extra audiences accepted on workload identity tokens, besides `nomadproject.io`.
    #[arg(long = "audience", env = "DHV_BINDER_AUDIENCES", value_delimiter = ',')]
    pub audiences: Vec<String>,
    /// Serve Prometheus metrics at `http://<addr>/metrics` (e.g. `127.0.0.1:9464`); off
    /// when unset. The endpoint has no authentication: keep it on loopback.
    #[arg(long, env = "DHV_BINDER_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Log line format: `text` for people, `json` (one object a line) for log shippers.
    #[arg(long, env = "DHV_BINDER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Where plugins' long-lived helpers (FUSE servers) run: a directory on the cgroup v2
    /// filesystem under which every published volume gets a cgroup of its own, outside the
    /// agent's, so that they outlive the agent's task (docs/operations/upgrades.md, "Helper
    /// cgroups"). `auto`: `<cgroup2 mount>/dhv-binder.slice`; `none`: no helper cgroups
    /// (helpers then share the agent's cgroup, and Nomad kills them with it).
    #[arg(long, env = "DHV_BINDER_HELPER_CGROUP", default_value = "auto")]
    pub helper_cgroup: HelperCgroupSetting,
    /// `memory.max` of each volume's helper cgroup (`512MiB`, `2GiB`, bytes; `max`: no limit),
    /// applied where the kernel offers the memory controller under the helper cgroups.
    #[arg(long, env = "DHV_BINDER_HELPER_MEMORY_MAX", default_value = "512MiB")]
    pub helper_memory_max: MemoryMax,
    /// The cgroup under which the local Nomad client runs its tasks, whose cgroups name
    /// their allocations (docs/architecture.md, "Whose process"). A directory under the
    /// cgroup2 mount or a cgroup path. Unset: Nomad's (`nomad.slice` on cgroups v2, `/nomad`
    /// on v1: `client/lib/cgroupslib/switch_linux.go` `NomadCgroupParent`, which the
    /// client's `cgroup_parent` setting does not change). Set it only for a simulated
    /// cluster, whose clients each have their own.
    #[arg(long, env = "DHV_BINDER_NOMAD_CGROUP_PARENT")]
    pub nomad_cgroup_parent: Option<String>,
    /// Cgroups whose processes are on other Nomad nodes simulated on this host (a test
    /// cluster: each simulated client's `cgroup_parent`, its agent's and helpers' cgroups),
    /// comma-separated: the fence does not kill them and an unpublish does not wait for
    /// them. Never set on a real node: every process of the host is the node's.
    #[arg(
        long = "other-node-cgroup",
        env = "DHV_BINDER_OTHER_NODE_CGROUPS",
        value_delimiter = ','
    )]
    pub other_node_cgroups: Vec<String>,
}

/// Where helper cgroups live (`--helper-cgroup`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelperCgroupSetting {
    /// `<cgroup2 mount>/dhv-binder.slice`, or none when no cgroup v2 filesystem is mounted.
    Auto,
    /// No helper cgroups.
    None,
    /// Under this directory of the cgroup v2 filesystem.
    Under(PathBuf),
}

impl std::str::FromStr for HelperCgroupSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            p if p.starts_with('/') => Ok(Self::Under(PathBuf::from(p))),
            other => Err(format!(
                "{other:?} is neither `auto`, `none` nor an absolute directory on the cgroup v2 filesystem"
            )),
        }
    }
}

/// A memory limit in bytes (`--helper-memory-max`); `None`: no limit (`max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryMax(pub Option<u64>);

impl std::str::FromStr for MemoryMax {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "max" {
            return Ok(Self(None));
        }
        let b: bytesize::ByteSize = s
            .parse()
            .map_err(|e| format!("{s:?} is not a size such as 512MiB, 2GiB or `max`: {e}"))?;
        if b.as_u64() < 1 << 20 {
            return Err(format!("{s:?} is below 1 MiB: no helper runs in that"));
        }
        Ok(Self(Some(b.as_u64())))
    }
}

/// The agent's log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    #[default]
    Text,
    /// One JSON object a line, with the event's fields (`volume`, `alloc_id`, ...) as keys.
    Json,
}

/// A configuration that cannot work. The CLI exits with code 64 (EX_USAGE).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{what} must be an absolute path, got {path}")]
    NotAbsolute { what: &'static str, path: PathBuf },
    #[error("NOMAD_ADDR must be http://, https:// or unix:///absolute/path (the Task API socket), got {0}")]
    BadAddress(String),
    #[error("NOMAD_CLIENT_CERT and NOMAD_CLIENT_KEY must be set together")]
    HalfClientCert,
    #[error("{what} must be greater than zero")]
    Zero { what: &'static str },
    /// A fence margin that leaves no room for renewals before the fence.
    #[error("--claim-fence-margin {got:?} is too large: at most --claim-lock-delay + --claim-ttl/3 ({max:?}), so that a claim is fenced only after two renewals failed; lower the margin or raise --claim-lock-delay")]
    FenceMargin { got: Duration, max: Duration },
    /// A `--max-volumes` setting that is not `<plugin_id>=<N>` with N a whole number.
    #[error("--max-volumes {0:?} must be <plugin_id>=<N> with N a whole number (0 offers none of the plugin's volumes), e.g. ebs=25")]
    MaxVolumes(String),
    /// Outside the range Nomad accepts.
    #[error(
        "{what} must lie between {min:?} and {max:?} (Nomad refuses other values), got {got:?}"
    )]
    OutOfRange {
        what: &'static str,
        min: Duration,
        max: Duration,
        got: Duration,
    },
}

/// The URL scheme of a unix socket address.
pub const UNIX_SCHEME: &str = "unix://";

/// Where the Nomad API is: the parsed form of `NOMAD_ADDR` (how requests reach it is
/// the Nomad client's transport's concern).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `http://host:port` or `https://host:port`: requests go to this base URL.
    Tcp(String),
    /// `unix:///path`: requests go over this socket, with `http://localhost` as the URL base.
    Unix(PathBuf),
}

/// An address that is neither `http(s)://` nor `unix://` with an absolute path.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("NOMAD_ADDR must be http://, https:// or unix:///absolute/path (the Task API socket, NOMAD_UNIX_ADDR), got {0}")]
pub struct BadAddress(pub String);

impl Endpoint {
    /// Parses a NOMAD_ADDR-style address.
    pub fn parse(addr: &str) -> Result<Self, BadAddress> {
        if let Some(p) = addr.strip_prefix(UNIX_SCHEME) {
            let path = PathBuf::from(p);
            return if path.is_absolute() {
                Ok(Endpoint::Unix(path))
            } else {
                Err(BadAddress(addr.into()))
            };
        }
        if addr.starts_with("http://") || addr.starts_with("https://") {
            return Ok(Endpoint::Tcp(addr.trim_end_matches('/').to_string()));
        }
        Err(BadAddress(addr.into()))
    }
}

/// The lock TTLs Nomad accepts (`nomad/structs/variables.go` `VariableLock.Validate`).
pub const CLAIM_TTL_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(10)..=Duration::from_secs(24 * 3600);

impl NomadConfig {
    /// Settings for a plain-HTTP agent at `address` with no token, no TLS, the `default`
    /// namespace and the agent's region: what tests and benchmarks need.
    pub fn plain(address: &str) -> Self {
        Self {
            address: address.to_string(),
            token: None,
            region: None,
            namespace: "default".into(),
            ca_cert: None,
            ca_path: None,
            tls_server_name: None,
            http_auth: None,
            client_cert: None,
            client_key: None,
            skip_verify: false,
        }
    }

    /// Checks the settings without touching the network.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if Endpoint::parse(&self.address).is_err() {
            return Err(ConfigError::BadAddress(self.address.clone()));
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err(ConfigError::HalfClientCert);
        }
        Ok(())
    }
}

/// The Nomad settings `dhv-binder agent` uses, and what it set aside
/// ([`NomadConfig::for_agent`]).
#[derive(Debug, Clone)]
pub struct AgentNomad {
    /// The settings to build the agent's client from.
    pub config: NomadConfig,
    /// One line per setting set aside, saying why and what to do instead.
    pub set_aside: Vec<String>,
}

impl NomadConfig {
    /// What `dhv-binder agent` makes of the Nomad settings, most of which may come from a
    /// Nomad client's own environment: a client passes its `NOMAD_*` variables to the
    /// raw_exec and exec tasks it starts, all but `NOMAD_TOKEN` and `NOMAD_LICENSE*`
    /// (`client/allocrunner/taskrunner/task_dir_hook.go` `setEnvvars`,
    /// `client/taskenv/env.go` `SetHostEnvvars`, deny list
    /// `command/agent/host/host.go` `DefaultEnvDenyList`); the task's own `env` block and
    /// `NOMAD_REGION`/`NOMAD_NAMESPACE` (set from the allocation) win over them
    /// (`Builder.buildEnv`). So, for the agent:
    /// - `NOMAD_SKIP_VERIFY` from the environment (`skip_verify_from_env`) is set aside:
    ///   TLS certificates stay verified; only `--tls-skip-verify` on the command line turns
    ///   the check off (testing only);
    /// - with a `unix://` address (the Task API socket) and no `fallback_addresses`, the TLS
    ///   settings (`NOMAD_CACERT`, `NOMAD_CAPATH`, `NOMAD_CLIENT_CERT`, `NOMAD_CLIENT_KEY`,
    ///   `NOMAD_TLS_SERVER_NAME`, `NOMAD_SKIP_VERIFY`) and `NOMAD_HTTP_AUTH` are set aside:
    ///   nothing on a socket uses them, a file the task cannot read (an exec task's chroot)
    ///   must not stop the agent, and a proxy's password is not sent to the local agent;
    /// - with fallback addresses they apply to those (`https://` servers).
    pub fn for_agent(
        &self,
        skip_verify_from_env: bool,
        fallback_addresses: &[String],
    ) -> AgentNomad {
        let mut config = self.clone();
        let mut set_aside = Vec::new();
        if config.skip_verify && skip_verify_from_env {
            config.skip_verify = false;
            set_aside.push("NOMAD_SKIP_VERIFY is set in the environment (a Nomad client passes its own NOMAD_* variables to the raw_exec and exec tasks it starts): TLS certificates are verified anyway; to turn the check off for the agent (testing only), pass --tls-skip-verify".to_string());
        }
        let socket_only = matches!(Endpoint::parse(&config.address), Ok(Endpoint::Unix(_)))
            && fallback_addresses.iter().all(|a| a.trim().is_empty());
        if socket_only {
            let mut unused = Vec::new();
            if config.ca_cert.take().is_some() {
                unused.push("NOMAD_CACERT");
            }
            if config.ca_path.take().is_some() {
                unused.push("NOMAD_CAPATH");
            }
            if config.client_cert.take().is_some() {
                unused.push("NOMAD_CLIENT_CERT");
            }
            if config.client_key.take().is_some() {
                unused.push("NOMAD_CLIENT_KEY");
            }
            if config.tls_server_name.take().is_some() {
                unused.push("NOMAD_TLS_SERVER_NAME");
            }
            if std::mem::take(&mut config.skip_verify) {
                unused.push("NOMAD_SKIP_VERIFY");
            }
            if config.http_auth.take().is_some() {
                unused.push("NOMAD_HTTP_AUTH");
            }
            if !unused.is_empty() {
                set_aside.push(format!(
                    "{} not used: NOMAD_ADDR is the Task API socket {} and no --fallback-address is set (a Nomad client passes its own NOMAD_* variables to the tasks it starts)",
                    unused.join(", "),
                    config.address
                ));
            }
        }
        AgentNomad { config, set_aside }
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
            ("--usage-interval", self.usage_interval),
            ("--check-interval", self.check_interval),
            ("--stream-idle-timeout", self.stream_idle_timeout),
            ("--claim-ttl", self.claim_ttl),
            ("--heartbeat-interval-max", self.heartbeat_interval_max),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Zero { what });
            }
        }
        if !CLAIM_TTL_RANGE.contains(&self.claim_ttl) {
            return Err(ConfigError::OutOfRange {
                what: "--claim-ttl",
                min: *CLAIM_TTL_RANGE.start(),
                max: *CLAIM_TTL_RANGE.end(),
                got: self.claim_ttl,
            });
        }
        // Nomad turns a zero lock delay into its 15 s default; say so rather than surprise.
        if self.claim_lock_delay.is_zero() {
            return Err(ConfigError::Zero {
                what: "--claim-lock-delay",
            });
        }
        let max = self.claim_lock_delay + self.claim_ttl / 3;
        let margin = self.fence_margin();
        if margin.is_zero() {
            return Err(ConfigError::Zero {
                what: "--claim-fence-margin",
            });
        }
        if margin > max {
            return Err(ConfigError::FenceMargin { got: margin, max });
        }
        self.max_volumes_by_plugin()?;
        Ok(())
    }

    /// `--max-volumes` by plugin ID.
    pub fn max_volumes_by_plugin(
        &self,
    ) -> Result<std::collections::BTreeMap<String, u32>, ConfigError> {
        self.max_volumes
            .iter()
            .map(|s| {
                s.split_once('=')
                    .filter(|(p, _)| !p.is_empty())
                    .and_then(|(p, n)| Some((p.to_string(), n.trim().parse().ok()?)))
                    .ok_or_else(|| ConfigError::MaxVolumes(s.clone()))
            })
            .collect()
    }

    /// The fence margin: `--claim-fence-margin`, by default the claim TTL (or the largest
    /// legal margin, lock delay + TTL/3, when that is smaller).
    pub fn fence_margin(&self) -> Duration {
        self.claim_fence_margin.unwrap_or_else(|| {
            self.claim_ttl
                .min(self.claim_lock_delay + self.claim_ttl / 3)
        })
    }

    /// DHV_VOLUMES_DIR for plugins.
    pub fn volumes_dir(&self) -> PathBuf {
        self.volumes_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("volumes"))
    }

    /// Root of the placeholder mount points.
    pub fn mount_root(&self) -> PathBuf {
        self.state_dir.join("mnt")
    }
}

/// Which source of truth the watcher uses (`--watch-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WatchMode {
    /// The cluster-wide event stream, filtered on this node (cheap below a few hundred
    /// nodes; every node reads every allocation event of the cluster).
    Stream,
    /// Node-scoped blocking queries on the node's allocation list (costs scale with this
    /// node's own changes only; the default, see docs/scale.md).
    #[default]
    Poll,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentConfig,
    }

    fn agent(args: &[&str]) -> AgentConfig {
        let mut argv = vec!["dhv-binder"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).expect("arguments parse").agent
    }

    #[test]
    fn claim_ttl_must_lie_in_nomads_lock_ttl_range() {
        assert!(agent(&[]).validate().is_ok(), "defaults are legal");
        for ttl in ["6s", "9s", "25h"] {
            let err = agent(&["--claim-ttl", ttl]).validate().unwrap_err();
            assert!(
                matches!(
                    err,
                    ConfigError::OutOfRange {
                        what: "--claim-ttl",
                        ..
                    }
                ),
                "{ttl}: {err}"
            );
        }
        for ttl in ["10s", "24h"] {
            assert!(agent(&["--claim-ttl", ttl]).validate().is_ok(), "{ttl}");
        }
        assert!(matches!(
            agent(&["--claim-lock-delay", "0s"]).validate(),
            Err(ConfigError::Zero {
                what: "--claim-lock-delay"
            })
        ));
    }

    /// The fence comes a margin before the lease ends; the margin defaults to the TTL and
    /// must leave two renewal periods (2 x TTL/3) after the last renewal that succeeded.
    #[test]
    fn the_fence_margin_defaults_to_the_ttl_and_leaves_room_for_renewals() {
        assert_eq!(agent(&[]).fence_margin(), Duration::from_secs(15));
        let short = agent(&["--claim-ttl", "30s", "--claim-lock-delay", "2s"]);
        assert_eq!(short.fence_margin(), Duration::from_secs(12), "capped");
        assert!(short.validate().is_ok());
        let err = agent(&["--claim-fence-margin", "21s"])
            .validate()
            .unwrap_err();
        assert!(matches!(err, ConfigError::FenceMargin { .. }), "{err}");
        assert!(err.to_string().contains("--claim-lock-delay"), "{err}");
        assert!(agent(&["--claim-fence-margin", "20s"]).validate().is_ok());
        assert!(matches!(
            agent(&["--claim-fence-margin", "0s"]).validate(),
            Err(ConfigError::Zero { .. })
        ));
    }

    /// Issue 45 #7: what the agent makes of NOMAD_* variables it may have inherited from
    /// its Nomad client. An inherited NOMAD_SKIP_VERIFY does not turn TLS verification off
    /// (only --tls-skip-verify does); over the Task API socket without fallbacks the TLS
    /// settings and the proxy password are set aside (an unreadable inherited CA path no
    /// longer stops the agent); with fallback servers they apply to those.
    #[test]
    fn the_agent_sets_aside_what_a_nomad_client_passes_down() {
        let inherited = NomadConfig {
            ca_cert: Some("/etc/nomad.d/ca.pem".into()),
            client_cert: Some("/etc/nomad.d/cli.pem".into()),
            client_key: Some("/etc/nomad.d/cli-key.pem".into()),
            http_auth: Some("proxy:secret".into()),
            skip_verify: true,
            ..NomadConfig::plain("https://127.0.0.1:4646")
        };
        let a = inherited.for_agent(true, &[]);
        assert!(!a.config.skip_verify, "inherited: verification stays on");
        assert_eq!(a.config.ca_cert, inherited.ca_cert, "TCP: the CA applies");
        assert_eq!(a.set_aside.len(), 1, "{:?}", a.set_aside);
        assert!(
            a.set_aside[0].contains("--tls-skip-verify"),
            "{:?}",
            a.set_aside
        );
        let flag = inherited.for_agent(false, &[]);
        assert!(
            flag.config.skip_verify,
            "--tls-skip-verify on the command line"
        );
        assert!(flag.set_aside.is_empty());

        let socket = NomadConfig {
            address: "unix:///alloc/secrets/api.sock".into(),
            ..inherited.clone()
        };
        let a = socket.for_agent(true, &[]);
        assert_eq!(
            (
                &a.config.ca_cert,
                &a.config.client_cert,
                &a.config.client_key,
                &a.config.http_auth,
                a.config.skip_verify
            ),
            (&None, &None, &None, &None, false)
        );
        assert!(
            a.set_aside[1].starts_with(
                "NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, NOMAD_HTTP_AUTH not used"
            ),
            "{:?}",
            a.set_aside
        );
        // With fallback servers, the TLS settings are theirs.
        let a = socket.for_agent(false, &["https://nomad-1:4646".to_string()]);
        assert_eq!(a.config.ca_cert, inherited.ca_cert);
        assert_eq!(a.config.http_auth, inherited.http_auth);
        assert!(a.config.skip_verify);
    }
}
