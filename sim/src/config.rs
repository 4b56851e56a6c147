//! Agent configuration (`nomad-sim agent -config <file.hcl>`), validated before anything binds.

use crate::hcl_value::{attributes, label, Attrs, HclError};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors loading the agent config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {0}: {1}")]
    Read(PathBuf, std::io::Error),
    /// HCL syntax or type error.
    #[error(transparent)]
    Hcl(#[from] HclError),
    /// A semantic problem.
    #[error("{0}")]
    Invalid(String),
}

/// A static host volume of a client (`client { host_volume "name" { path, read_only } }`).
#[derive(Debug, Clone)]
pub struct StaticHostVolume {
    /// Volume name.
    pub name: String,
    /// Host path.
    pub path: PathBuf,
    /// Read-only flag.
    pub read_only: bool,
}

/// One simulated client node.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Node name (block label).
    pub name: String,
    /// Node pool, default "default".
    pub node_pool: String,
    /// Datacenter, defaults to the agent's.
    pub datacenter: String,
    /// Port for this node's client-agent HTTP API (0 = any).
    pub http_port: u16,
    /// Host path → chroot path for the exec driver.
    pub chroot_env: BTreeMap<String, String>,
    /// Static host volumes.
    pub host_volumes: Vec<StaticHostVolume>,
    /// Node meta.
    pub meta: BTreeMap<String, String>,
    /// `cgroup_parent`: the parent of this node's task cgroups (absolute, or relative to the
    /// cgroup2 mount as Nomad's `cgroup_parent`); `None`: tasks run without cgroups (the
    /// simulator has no default, so it never uses the host's own `nomad.slice`).
    pub cgroup_parent: Option<PathBuf>,
}

/// ACL settings (`acl { enabled = true }`), plus the sim's bootstrap token.
#[derive(Debug, Clone, Default)]
pub struct AclConfig {
    /// Whether ACLs are enforced.
    pub enabled: bool,
    /// Secret ID of a management token created at start (sim-only convenience).
    pub bootstrap_token: Option<String>,
}

/// The servers' heartbeat settings (`server { min_heartbeat_ttl, max_heartbeats_per_second }`;
/// Nomad's defaults 10 s and 50, `nomad/config.go` `DefaultConfig`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeartbeatSettings {
    /// `min_heartbeat_ttl`: the shortest TTL a server gives a client.
    pub min_ttl: std::time::Duration,
    /// `max_heartbeats_per_second`: the cluster-wide heartbeat rate the TTL aims at.
    pub max_per_second: f64,
}

impl Default for HeartbeatSettings {
    fn default() -> Self {
        HeartbeatSettings {
            min_ttl: std::time::Duration::from_secs(10),
            max_per_second: 50.0,
        }
    }
}

/// The Nomad version the simulator speaks (`nomad_version = "1.10.5"`, sim-only; default
/// 2.0.5): where Nomad's behaviour differs between the versions dhv-binder supports, the
/// simulator follows this one (docs/simulator.md, "Versions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NomadVersion(pub u32, pub u32, pub u32);

impl Default for NomadVersion {
    fn default() -> Self {
        NomadVersion(2, 0, 5)
    }
}

impl std::fmt::Display for NomadVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

impl std::str::FromStr for NomadVersion {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let bad = || {
            ConfigError::Invalid(format!(
                "nomad_version {s:?}: expected MAJOR.MINOR.PATCH, 1.10.0 or later"
            ))
        };
        let mut parts = s.split('.').map(|p| p.parse::<u32>().map_err(|_| bad()));
        let v = NomadVersion(
            parts.next().ok_or_else(bad)??,
            parts.next().ok_or_else(bad)??,
            parts.next().ok_or_else(bad)??,
        );
        if parts.next().is_some() || v < NomadVersion(1, 10, 0) {
            return Err(bad());
        }
        Ok(v)
    }
}

impl NomadVersion {
    /// Whether a Job event of a job deleted from the state carries `"Deleted": true`
    /// (`nomad/structs/event.go` `JobEvent.Deleted`, hashicorp/nomad#27614: v1.11.3 and
    /// v2.0.0 on; before, `nomad/state/events.go` `eventFromChange` sends `{"Job": …}` only).
    pub fn job_event_deleted(self) -> bool {
        self >= NomadVersion(1, 11, 3)
    }
}

/// The whole agent config.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Everything the sim writes goes under here.
    pub data_dir: PathBuf,
    /// Listen address.
    pub bind_addr: String,
    /// Server HTTP port (0 = any).
    pub http_port: u16,
    /// Region name.
    pub region: String,
    /// Datacenter.
    pub datacenter: String,
    /// Event ring buffer size in frames (min 100 in Nomad when 0; here 0 → 100, else as set).
    pub event_buffer_size: usize,
    /// Heartbeat interval of event streams (Nomad: fixed 30s).
    pub event_heartbeat_interval: Duration,
    /// Node heartbeat TTL: a node that stops heartbeating is marked down after this.
    pub heartbeat_grace: Duration,
    /// `server { min_heartbeat_ttl, max_heartbeats_per_second }`: the TTL the servers give
    /// each client, and so how often it heartbeats (`nomad/heartbeat.go`
    /// `resetHeartbeatTimer`; 10 s and 50 by default, 10–20 s up to 500 nodes).
    pub heartbeat: HeartbeatSettings,
    /// ACLs.
    pub acl: AclConfig,
    /// `server { oidc_issuer = "..." }`: the `iss` of every workload identity and the
    /// issuer of `/.well-known/openid-configuration`; unset, tokens carry no `iss` and that
    /// endpoint answers 404 (Nomad: `nomad/encrypter.go` `SignClaims`,
    /// `command/agent/keyring_endpoint.go` `OIDCDiscoveryRequest`).
    pub oidc_issuer: Option<String>,
    /// `limits { http_max_conns_per_client = N }` (default 100, 0: no limit): a client
    /// node's HTTP listener closes a new connection at once while its peer address already
    /// has this many open (Nomad: `command/agent/http.go` `makeConnState`, go-connlimit's
    /// `HTTPConnStateFunc`; the default in `command/agent/config.go` `DefaultConfig`).
    pub http_max_conns_per_client: usize,
    /// Simulated client nodes.
    pub clients: Vec<ClientConfig>,
    /// `nomad_version` (sim-only): the Nomad version whose shapes the simulator speaks.
    pub nomad_version: NomadVersion,
}

/// Nomad's exec driver default `chroot_env` (`drivers/shared/executor` `chrootEnv`).
pub const DEFAULT_CHROOT: &[&str] = &[
    "/bin",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/run/resolvconf",
    "/sbin",
    "/usr",
];

fn duration(a: &Attrs, k: &str, default: Duration) -> Result<Duration, ConfigError> {
    match a.str(k)? {
        None => Ok(default),
        Some(s) => crate::clock::parse_go_duration(&s)
            .map_err(|e| ConfigError::Invalid(format!("{k}: {e}"))),
    }
}

impl AgentConfig {
    /// Loads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let src =
            std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
        Self::parse(&src)
    }

    /// Parses config text.
    pub fn parse(src: &str) -> Result<Self, ConfigError> {
        // Nomad (HCL1) writes `chroot_env { "/bin" = "/bin" }`; HCL2 needs an object attribute.
        let src = rewrite_chroot_blocks(src);
        let body: hcl::Body = hcl::parse(&src).map_err(HclError::from)?;
        let attrs = attributes("config", &body)?;
        let a = Attrs::new("config", &attrs);
        let data_dir = PathBuf::from(
            a.str("data_dir")?
                .ok_or_else(|| ConfigError::Invalid("data_dir is required".into()))?,
        );
        if !data_dir.is_absolute() {
            return Err(ConfigError::Invalid("data_dir must be absolute".into()));
        }
        let datacenter = a.str("datacenter")?.unwrap_or_else(|| "dc1".into());
        let mut cfg = AgentConfig {
            data_dir,
            bind_addr: a.str("bind_addr")?.unwrap_or_else(|| "127.0.0.1".into()),
            http_port: 4646,
            region: a.str("region")?.unwrap_or_else(|| "global".into()),
            datacenter: datacenter.clone(),
            event_buffer_size: match a.int("event_buffer_size")?.unwrap_or(100) {
                0 => 100,
                n if n < 0 => return Err(ConfigError::Invalid("event_buffer_size < 0".into())),
                n => n as usize,
            },
            event_heartbeat_interval: duration(
                &a,
                "event_heartbeat_interval",
                Duration::from_secs(30),
            )?,
            heartbeat_grace: duration(&a, "heartbeat_grace", Duration::from_secs(10))?,
            heartbeat: Default::default(),
            acl: AclConfig::default(),
            oidc_issuer: None,
            http_max_conns_per_client: 100,
            clients: Vec::new(),
            nomad_version: match a.str("nomad_version")? {
                None => NomadVersion::default(),
                Some(v) => v.parse()?,
            },
        };
        for b in body.blocks() {
            match b.identifier.as_str() {
                "ports" => {
                    let pa = attributes("ports", &b.body)?;
                    if let Some(p) = Attrs::new("ports", &pa).int("http")? {
                        cfg.http_port = u16::try_from(p)
                            .map_err(|_| ConfigError::Invalid("ports.http out of range".into()))?;
                    }
                }
                "limits" => {
                    let la = attributes("limits", &b.body)?;
                    if let Some(n) = Attrs::new("limits", &la).int("http_max_conns_per_client")? {
                        // `command/agent/http.go` `newHTTPServer`: negative is refused.
                        cfg.http_max_conns_per_client = usize::try_from(n).map_err(|_| {
                            ConfigError::Invalid("http_max_conns_per_client must be >= 0".into())
                        })?;
                    }
                }
                "server" => {
                    let sa = attributes("server", &b.body)?;
                    let sa = Attrs::new("server", &sa);
                    cfg.oidc_issuer = sa.str("oidc_issuer")?.filter(|s| !s.is_empty());
                    // `command/agent/agent.go` `convertServerConfig`: 0 keeps the default.
                    let min_ttl = duration(&sa, "min_heartbeat_ttl", Duration::ZERO)?;
                    if !min_ttl.is_zero() {
                        cfg.heartbeat.min_ttl = min_ttl;
                    }
                    match sa.float("max_heartbeats_per_second")? {
                        Some(r) if r < 0.0 || !r.is_finite() => {
                            return Err(ConfigError::Invalid(
                                "server.max_heartbeats_per_second must be a positive number".into(),
                            ))
                        }
                        Some(r) if r > 0.0 => cfg.heartbeat.max_per_second = r,
                        _ => {}
                    }
                }
                "acl" => {
                    let aa = attributes("acl", &b.body)?;
                    let aa = Attrs::new("acl", &aa);
                    cfg.acl.enabled = aa.bool("enabled")?.unwrap_or(false);
                    cfg.acl.bootstrap_token = aa.str("bootstrap_token")?;
                }
                "client" => {
                    let name = label(b, 0).ok_or_else(|| {
                        ConfigError::Invalid("client block needs a node name label".into())
                    })?;
                    let ctx = format!("client.{name}");
                    let ca = attributes(&ctx, &b.body)?;
                    let ca = Attrs::new(&ctx, &ca);
                    let mut client = ClientConfig {
                        name: name.clone(),
                        node_pool: ca.str("node_pool")?.unwrap_or_else(|| "default".into()),
                        datacenter: ca.str("datacenter")?.unwrap_or_else(|| datacenter.clone()),
                        http_port: u16::try_from(ca.int("http_port")?.unwrap_or(0))
                            .map_err(|_| ConfigError::Invalid(format!("{ctx}.http_port")))?,
                        chroot_env: BTreeMap::new(),
                        host_volumes: Vec::new(),
                        meta: ca.string_map("meta")?.unwrap_or_default(),
                        cgroup_parent: ca.str("cgroup_parent")?.map(PathBuf::from),
                    };
                    let mut chroot_set = ca.string_map("chroot_env")?;
                    for inner in b.body.blocks() {
                        match inner.identifier.as_str() {
                            "chroot_env" => {
                                let m = attributes(&ctx, &inner.body)?;
                                let m = m
                                    .into_iter()
                                    .map(|(k, v)| (k, v.as_str().unwrap_or_default().to_string()))
                                    .collect();
                                chroot_set = Some(m);
                            }
                            "host_volume" => {
                                let vname = label(inner, 0).ok_or_else(|| {
                                    ConfigError::Invalid(format!("{ctx}.host_volume needs a name"))
                                })?;
                                let va = attributes(&ctx, &inner.body)?;
                                let va = Attrs::new(&format!("{ctx}.host_volume.{vname}"), &va);
                                let path = va.str("path")?.ok_or_else(|| {
                                    ConfigError::Invalid(format!(
                                        "{ctx}.host_volume.{vname}: path is required"
                                    ))
                                })?;
                                client.host_volumes.push(StaticHostVolume {
                                    name: vname,
                                    path: PathBuf::from(path),
                                    read_only: va.bool("read_only")?.unwrap_or(false),
                                });
                            }
                            "meta" => {
                                let m = attributes(&ctx, &inner.body)?;
                                for (k, v) in m {
                                    client
                                        .meta
                                        .insert(k, v.as_str().unwrap_or_default().to_string());
                                }
                            }
                            _ => {}
                        }
                    }
                    client.chroot_env = match chroot_set {
                        Some(m) => m,
                        None => DEFAULT_CHROOT
                            .iter()
                            .filter(|p| Path::new(p).exists())
                            .map(|p| (p.to_string(), p.to_string()))
                            .collect(),
                    };
                    if cfg.clients.iter().any(|c| c.name == client.name) {
                        return Err(ConfigError::Invalid(format!("duplicate client {name:?}")));
                    }
                    cfg.clients.push(client);
                }
                _ => {}
            }
        }
        Ok(cfg)
    }
}

fn rewrite_chroot_blocks(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("chroot_env") {
        out.push_str(&rest[..i + "chroot_env".len()]);
        rest = &rest[i + "chroot_env".len()..];
        let trimmed = rest.trim_start_matches([' ', '\t']);
        if trimmed.starts_with('{') {
            out.push_str(" = ");
            rest = trimmed;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_clients() {
        let cfg = AgentConfig::parse(
            r#"
data_dir = "/tmp/x"
ports { http = 0 }
event_buffer_size = 10
event_heartbeat_interval = "1s"
client "node-1" {
  node_pool = "default"
  chroot_env { "/usr" = "/usr" }
  host_volume "sock" {
    path = "/tmp"
    read_only = true
  }
}
client "node-2" {}
"#,
        )
        .unwrap();
        assert_eq!(cfg.http_port, 0);
        assert_eq!(cfg.event_buffer_size, 10);
        assert_eq!(cfg.clients.len(), 2);
        assert_eq!(cfg.clients[0].chroot_env.len(), 1);
        assert!(cfg.clients[0].host_volumes[0].read_only);
        assert!(cfg.clients[1].chroot_env.contains_key("/usr"));
    }

    /// `server { min_heartbeat_ttl, max_heartbeats_per_second }` as Nomad reads them (0 keeps
    /// the default) and the sim's `nomad_version` (1.10.0 on).
    #[test]
    fn parses_heartbeat_settings_and_the_nomad_version() {
        let cfg = AgentConfig::parse(
            "data_dir = \"/tmp/x\"\nnomad_version = \"1.11.2\"\nserver {\n  min_heartbeat_ttl = \"500ms\"\n  max_heartbeats_per_second = 0\n}\n",
        )
        .unwrap();
        assert_eq!(cfg.heartbeat.min_ttl, Duration::from_millis(500));
        assert_eq!(cfg.heartbeat.max_per_second, 50.0);
        assert_eq!(cfg.nomad_version, NomadVersion(1, 11, 2));
        assert!(!cfg.nomad_version.job_event_deleted());
        assert!(NomadVersion(1, 11, 3).job_event_deleted());
        assert!(AgentConfig::parse("data_dir = \"/tmp/x\"\nnomad_version = \"1.9.7\"\n").is_err());
        assert!(AgentConfig::parse("data_dir = \"/tmp/x\"\nnomad_version = \"2.0\"\n").is_err());
    }

    /// `RateScaledInterval(50, 10 s, n)`: 10 s up to 500 nodes, n/50 s above.
    #[test]
    fn the_heartbeat_ttl_scales_with_the_nodes() {
        let rate = crate::nodes::rate_scaled_interval;
        assert_eq!(
            rate(50.0, Duration::from_secs(10), 3),
            Duration::from_secs(10)
        );
        assert_eq!(
            rate(50.0, Duration::from_secs(10), 500),
            Duration::from_secs(10)
        );
        assert_eq!(
            rate(50.0, Duration::from_secs(10), 1000),
            Duration::from_secs(20)
        );
    }
}
