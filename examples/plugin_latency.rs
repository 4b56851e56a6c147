//! Publish/unpublish latency of a plugin, measured as the agent calls it (same runner, same
//! environment): one create, then N rounds of publish + unpublish on one target, median and
//! max of each, then delete. Run as root:
//!
//! ```sh
//! cargo run --release --example plugin_latency -- plugins/ext4 20 capacity=67108864
//! cargo run --release --example plugin_latency -- plugins/bind 20 export=/srv/export
//! cargo run --release --example plugin_latency -- plugins/webdav 20 url=http://127.0.0.1:8080/ secret:password=pw
//! ```
//! Arguments after the round count: `KEY=VALUE` parameters, `secret:KEY=VALUE` secrets,
//! `capacity=BYTES`. The reference plugins call `dhv-binder helper`: build the binary too
//! (`cargo build --release`), or name one in `DHV_BINDER`.

use dhv_binder::node::journal::{MountRecord, MountState};
use dhv_binder::storage::environment::{self, NodeEnv};
use dhv_binder::storage::plugin::{self, CreateResult, Operation, PublishResult, Runner};
use dhv_binder::volume::{Capability, VolumeRecord, VolumeSpec};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let plugin = std::path::absolute(PathBuf::from(
        args.first()
            .expect("usage: plugin_latency <plugin> [rounds] [KEY=VALUE]…"),
    ))?;
    let rounds: usize = args.get(1).map(|r| r.parse()).transpose()?.unwrap_or(20);
    let (mut params, mut secrets, mut capacity) = (BTreeMap::new(), BTreeMap::new(), 64u64 << 20);
    for a in args.iter().skip(2) {
        let (k, v) = a.split_once('=').expect("KEY=VALUE");
        match k.strip_prefix("secret:") {
            Some(s) => {
                secrets.insert(s.to_string(), v.to_string());
            }
            None if k == "capacity" => capacity = v.parse()?,
            None => {
                params.insert(k.to_string(), v.to_string());
            }
        }
    }
    let id = plugin.file_name().unwrap().to_str().unwrap().to_string();
    let scratch = std::env::temp_dir().join(format!("dhv-binder-bench-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(scratch.join("t"))?;
    // The storage named by absolute-path parameters (export=..., dir=...) is the plugin's
    // root, as a node's `--plugin-root <id>=<dir>` makes it.
    let roots: Vec<String> = params
        .values()
        .filter(|v| v.starts_with('/'))
        .map(|v| {
            let p = std::path::PathBuf::from(v);
            p.canonicalize().unwrap_or(p).display().to_string()
        })
        .collect();
    let mut runner = Runner::new(plugin.parent().unwrap(), Duration::from_secs(60))
        .with_allowed_roots(BTreeMap::from([(id.clone(), roots.join(":"))]));
    // The reference plugins call `dhv-binder helper` (DHV_BINDER): the build's own binary
    // beside this example's directory, unless DHV_BINDER names one.
    if std::env::var_os("DHV_BINDER").is_none() {
        let built = std::env::current_exe()
            .ok()
            .and_then(|e| Some(e.parent()?.parent()?.join("dhv-binder")))
            .filter(|p| p.is_file());
        match built {
            Some(b) => runner = runner.with_dhv_binder(&b),
            None => eprintln!("warning: no dhv-binder built beside this example and DHV_BINDER unset: the reference plugins will look for dhv-binder on PATH (cargo build --release first)"),
        }
    }
    let node = NodeEnv {
        node_id: uuid::Uuid::new_v4().to_string(),
        node_pool: "default".into(),
        volumes_dir: scratch.join("volumes"),
        plugin_dir: plugin.parent().unwrap().to_path_buf(),
    };
    let spec = VolumeSpec {
        name: "bench".into(),
        namespace: "default".into(),
        plugin_id: id.clone(),
        capacity_min: capacity,
        capacity_max: capacity,
        node_pool: String::new(),
        capabilities: vec![Capability {
            access_mode: "single-node-writer".into(),
            attachment_mode: "file-system".into(),
        }],
        parameters: params,
        source: Default::default(),
        mount_options: Default::default(),
        secret_refs: Default::default(),
        constraints: Vec::new(),
        topology_request: Default::default(),
        availability: Default::default(),
    };
    let mut rec = VolumeRecord::new(spec, secrets);
    let out = runner
        .call(
            &id,
            Operation::Create,
            &environment::create_env(&node, &rec),
            &rec.secrets,
        )
        .await?;
    rec.context = plugin::parse::<CreateResult>(&id, Operation::Create, &out.stdout)?.context;
    let target = scratch.join("t");
    let (mut pubs, mut unpubs) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let env = environment::publish_env(&node, &rec, &target, false, "bench");
        let t = Instant::now();
        let out = runner
            .call(&id, Operation::Publish, &env, &rec.secrets)
            .await?;
        pubs.push(t.elapsed().as_secs_f64() * 1000.0);
        let res: PublishResult = plugin::parse(&id, Operation::Publish, &out.stdout)?;
        std::fs::write(target.join(format!("round-{i}")), "x")?;
        let m = MountRecord {
            volume: rec.key(),
            volume_id: rec.id.clone(),
            plugin_id: id.clone(),
            state: MountState::Unpublishing,
            target: target.clone(),
            read_only: false,
            publish_context: res.context.into(),
            since: 0,
            last_error: String::new(),
            claim_id: None,
            mount: None,
        };
        let env = environment::unpublish_env(&node, &m, Some(&rec));
        let t = Instant::now();
        runner
            .call(&id, Operation::Unpublish, &env, &rec.secrets)
            .await?;
        unpubs.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    runner
        .call(
            &id,
            Operation::Delete,
            &environment::delete_env(&node, &rec),
            &rec.secrets,
        )
        .await?;
    let _ = std::fs::remove_dir_all(&scratch);
    let max = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    println!(
        "{id}: {rounds} rounds: publish median {:.1} ms (max {:.1}), unpublish median {:.1} ms (max {:.1})",
        median(&mut pubs.clone()),
        max(&pubs),
        median(&mut unpubs.clone()),
        max(&unpubs)
    );
    Ok(())
}
