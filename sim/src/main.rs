//! nomad-sim entry point: the exec helper runs before any runtime (single-threaded unshare).
#![forbid(unsafe_code)]

use clap::Parser;
use nomad_sim::cli::{normalize_args, Cli, Cmd};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("exec-task") {
        let Some(spec) = args.get(2) else {
            eprintln!("usage: nomad-sim exec-task <spec.json>");
            std::process::exit(2);
        };
        let err = nomad_sim::exec_driver::run(std::path::Path::new(spec));
        eprintln!("nomad-sim exec driver: {err}");
        std::process::exit(1);
    }
    if args.get(1).map(String::as_str) == Some("cgroup-exec") {
        // `nomad-sim cgroup-exec <cgroup> <command> [args...]`: the raw_exec driver's start in
        // the task's cgroup (Nomad's executor: `UseCgroupFD`); the environment, working
        // directory and file descriptors are the task's already.
        let (Some(cgroup), Some(command)) = (args.get(2), args.get(3)) else {
            eprintln!("usage: nomad-sim cgroup-exec <cgroup> <command> [args...]");
            std::process::exit(2);
        };
        if let Err(e) = nomad_sim::cgroup::enter_self(std::path::Path::new(cgroup)) {
            eprintln!("nomad-sim raw_exec driver: {e}");
            std::process::exit(1);
        }
        let err = std::os::unix::process::CommandExt::exec(
            std::process::Command::new(command).args(&args[4..]),
        );
        eprintln!("nomad-sim raw_exec driver: failed to exec {command}: {err}");
        std::process::exit(1);
    }
    if args.get(1).map(String::as_str) == Some("docker-task") {
        let Some(spec) = args.get(2) else {
            eprintln!("usage: nomad-sim docker-task <spec.json>");
            std::process::exit(2);
        };
        match nomad_sim::docker_driver::run(std::path::Path::new(spec)) {
            Ok(code) => std::process::exit(code),
            Err(err) => {
                eprintln!("nomad-sim docker driver: {err}");
                std::process::exit(1);
            }
        }
    }
    let cli = Cli::parse_from(normalize_args(args));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NOMAD_SIM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("starting runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = rt.block_on(async move {
        match cli.cmd {
            Cmd::Agent { config } => {
                let cfg = match nomad_sim::config::AgentConfig::load(&config) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("Error loading configuration from {}: {e}", config.display());
                        return 64;
                    }
                };
                match nomad_sim::agent::run(cfg).await {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("Error: {e:#}");
                        1
                    }
                }
            }
            other => match nomad_sim::cli::run_client_cmd(other).await {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("Error: {e:#}");
                    1
                }
            },
        }
    });
    std::process::exit(code);
}
