//! The `dhv-binder` binary: parses the command line and wires the modules together.
#![forbid(unsafe_code)]

use dhv_binder::cli::{self, Cli, Command, Failure};

/// jemalloc instead of glibc's malloc: after a teardown of hundreds of volumes glibc kept
/// ~18 MiB of freed pages in its arenas; jemalloc's decay gives them back within seconds
/// (settings in .cargo/config.toml, figures in docs/scale.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The log filter: `DHV_BINDER_LOG` as a default level and levels by module
/// (`warn,dhv_binder::agent=debug`), `info` when unset or invalid. `Targets`, not
/// `EnvFilter`: the same syntax without span and field filters, and without the regular
/// expression engine `EnvFilter` brings into the binary (docs/performance.md, "Optimised
/// for size").
fn log_filter() -> tracing_subscriber::filter::Targets {
    let info = || {
        tracing_subscriber::filter::Targets::new()
            .with_default(tracing::level_filters::LevelFilter::INFO)
    };
    match std::env::var("DHV_BINDER_LOG") {
        Err(_) => info(),
        Ok(v) => v.parse().unwrap_or_else(|e| {
            eprintln!(
                "warning: DHV_BINDER_LOG={v:?} is not a valid log filter ({e}); using \"info\""
            );
            info()
        }),
    }
}

fn init_tracing(format: dhv_binder::config::LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(log_filter());
    match format {
        dhv_binder::config::LogFormat::Text => registry
            .with(fmt.with_ansi(std::io::stderr().is_terminal()))
            .init(),
        // One object a line: the event's fields (volume, alloc_id, ...) are top-level keys.
        dhv_binder::config::LogFormat::Json => registry.with(fmt.json().flatten_event(true)).init(),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let config_err = |e: dhv_binder::config::ConfigError| Failure {
        code: cli::EXIT_CONFIG,
        message: e.to_string(),
    };
    cli.nomad.validate().map_err(config_err)?;
    match cli.command {
        Command::Agent(mut cfg) => {
            cfg.validate().map_err(config_err)?;
            // Before anything else: the host's mount namespace, and real directory paths.
            dhv_binder::node::host::preflight(&mut cfg).map_err(|e| Failure {
                code: match e {
                    dhv_binder::node::host::HostError::Mounts(_) => cli::EXIT_FAILED,
                    _ => cli::EXIT_CONFIG,
                },
                message: e.to_string(),
            })?;
            init_tracing(cfg.log_format);
            // A Nomad client passes its own NOMAD_* variables to the tasks it starts: what
            // the agent sets aside of them (docs/operations/installing.md, "Inherited NOMAD_* variables").
            let nomad = cli
                .nomad
                .for_agent(cli.skip_verify_from_env, &cfg.fallback_addresses);
            for why in &nomad.set_aside {
                tracing::warn!("{why}");
            }
            tracing::info!(address = %nomad.config.address, "talking to Nomad");
            let client = dhv_binder::nomad::Client::new(&nomad.config)?
                .with_fallbacks(&nomad.config, &cfg.fallback_addresses)?;
            // One registry, always kept by the agent; served only with --metrics-addr.
            let metrics = dhv_binder::metrics::Metrics::new();
            let _metrics_endpoint = match cfg.metrics_addr {
                Some(addr) => {
                    let l = dhv_binder::metrics::bind(addr).await.map_err(|e| Failure {
                        code: cli::EXIT_CONFIG,
                        message: e.to_string(),
                    })?;
                    let addr = l.local_addr().unwrap_or(addr);
                    tracing::info!(%addr, "serving metrics at /metrics");
                    Some(tokio::spawn(dhv_binder::metrics::serve(l, metrics.clone())))
                }
                None => None,
            };
            dhv_binder::agent::run(cfg, client, metrics, shutdown_signal())
                .await
                .map_err(|e| Failure {
                    code: match e {
                        dhv_binder::agent::StartError::AgentSelf(_) => cli::EXIT_UNAVAILABLE,
                        dhv_binder::agent::StartError::NotAClient(_) => cli::EXIT_CONFIG,
                        dhv_binder::agent::StartError::Host(
                            dhv_binder::node::host::HostError::Mounts(_),
                        ) => cli::EXIT_FAILED,
                        dhv_binder::agent::StartError::Host(_)
                        | dhv_binder::agent::StartError::Trust(_)
                        | dhv_binder::agent::StartError::PluginRoot(_)
                        | dhv_binder::agent::StartError::Journal(
                            dhv_binder::node::journal::JournalError::NewerFormat { .. },
                        ) => cli::EXIT_CONFIG,
                        _ => cli::EXIT_FAILED,
                    },
                    message: e.to_string(),
                })
        }
        other => cli::run(&cli.nomad, other).await,
    }
}

/// How long a thread of the runtime's blocking pool (mount table reads, journal writes,
/// holder scans) waits for work before it ends. Tokio's default is 10 s; a burst of
/// unpublishes grows the pool to about `--max-parallel` threads, and work now and then (a
/// resync, one publish) hands a task to the longest-idle thread, so with 10 s none ever
/// ended and the burst's threads and stacks stayed (docs/performance.md, "Allocator, connections and threads"). A thread is
/// started again in about 0.05 ms when needed.
const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

fn main() {
    let cli = Cli::parse_args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build();
    let fail = |f: Failure| -> ! {
        eprintln!("Error: {}", f.message);
        std::process::exit(f.code);
    };
    match runtime {
        // On failure the process exits inside the runtime, as `#[tokio::main]` did: dropping
        // the runtime first would wait for its blocking threads (a probe stuck on a hung
        // mount among them).
        Ok(rt) => rt.block_on(async {
            if let Err(f) = run(cli).await {
                fail(f)
            }
        }),
        Err(e) => fail(Failure {
            code: cli::EXIT_FAILED,
            message: format!("cannot start the async runtime: {e}"),
        }),
    }
}
