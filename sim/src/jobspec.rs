//! Jobspec (HCL2) parsing into [`Job`], the subset dhv-binder's jobs use.
//!
//! Nomad API: `POST /v1/jobs/parse` (`command/agent/job_endpoint.go` `JobsParseRequest`).
//! Supported: job (type, namespace, region, datacenters, node_pool, priority, meta, constraint),
//! update (job and group: max_parallel, canary, auto_promote, auto_revert, health_check,
//! min_healthy_time, healthy_deadline, progress_deadline, stagger; the job's block is merged
//! under each group's as `TaskGroup.Canonicalize` does), group (count, volume, restart,
//! reschedule, constraint, meta, shutdown_delay, disconnect, max_client_disconnect,
//! stop_after_client_disconnect;
//! network ports (`static`, `to`; see `networks`), service ignored), task (driver, user, config, env, meta, lifecycle, volume_mount, identity,
//! kill_timeout, kill_signal, shutdown_delay, resources, restart, leader, artifact with
//! source, destination and `options { checksum }`: see [`crate::artifact`]).

use crate::hcl_value::{attributes, label, map_attr_or_block, Attrs, HclError};
use crate::structs::{
    Constraint, Job, Lifecycle, ReschedulePolicy, Resources, RestartPolicy, Task, TaskGroup,
    VolumeMount, VolumeRequest, WorkloadIdentity,
};
use hcl::Body;
use std::collections::BTreeMap;

/// Parses a jobspec with its variables' defaults. Errors carry the path of the offending
/// attribute.
pub fn parse(src: &str) -> Result<Job, HclError> {
    parse_with_variables(src, "")
}

/// Parses a jobspec, its `variable` blocks set from `var_file` (HCL attributes,
/// `name = "value"`: what `nomad job run -var name=value` and `-var-file` send as
/// `Variables` to `POST /v1/jobs/parse`), else from their `default`. A variable is used as
/// `var.<name>` or `${var.<name>}` inside a string (Nomad: `jobspec2/parse.go` `ParseWithConfig`,
/// `jobspec2/types.variables.go` `collectVariableValues`). Errors: a variable set but not
/// declared, used but not declared, or declared without a default and not set.
pub fn parse_with_variables(src: &str, var_file: &str) -> Result<Job, HclError> {
    let mut body: Body = hcl::parse(src)?;
    let vars = variables(&body, var_file)?;
    body.0
        .retain(|s| !matches!(s, hcl::Structure::Block(b) if b.identifier.as_str() == "variable"));
    substitute_body(&mut body, &vars)?;
    let job_block = body
        .blocks()
        .find(|b| b.identifier.as_str() == "job")
        .ok_or_else(|| HclError::Invalid("jobspec".into(), "missing job block".into()))?;
    let id = label(job_block, 0)
        .ok_or_else(|| HclError::Invalid("job".into(), "missing job name label".into()))?;
    let ctx = format!("job.{id}");
    let attrs = attributes(&ctx, &job_block.body)?;
    let a = Attrs::new(&ctx, &attrs);
    let mut job = Job {
        ID: id.clone(),
        Name: a.str("name")?.unwrap_or(id.clone()),
        Type: a.str("type")?.unwrap_or_default(),
        Namespace: a.str("namespace")?.unwrap_or_default(),
        Region: a.str("region")?.unwrap_or_default(),
        Datacenters: a.strings("datacenters")?.unwrap_or_default(),
        NodePool: a.str("node_pool")?.unwrap_or_default(),
        Priority: a.int("priority")?.unwrap_or(0),
        AllAtOnce: a.bool("all_at_once")?.unwrap_or(false),
        Meta: map_attr_or_block(&ctx, &job_block.body, "meta")?,
        Constraints: constraints(&ctx, &job_block.body)?,
        Update: update(&ctx, &job_block.body)?,
        ..Default::default()
    };
    for g in job_block
        .body
        .blocks()
        .filter(|b| b.identifier.as_str() == "group")
    {
        let mut tg = parse_group(&ctx, g)?;
        if let Some(job_update) = job.Update.as_object() {
            let mut merged = job_update.clone();
            if let Some(own) = tg.Update.as_object() {
                merged.extend(own.clone());
            }
            tg.Update = serde_json::Value::Object(merged);
        }
        job.TaskGroups.push(tg);
    }
    Ok(job)
}

/// The variables' values: `var_file`'s settings over the declared defaults.
fn variables(body: &Body, var_file: &str) -> Result<BTreeMap<String, String>, HclError> {
    let mut declared = BTreeMap::new();
    for b in body
        .blocks()
        .filter(|b| b.identifier.as_str() == "variable")
    {
        let name = label(b, 0)
            .ok_or_else(|| HclError::Invalid("variable".into(), "missing name label".into()))?;
        let ctx = format!("variable.{name}");
        // `type` is a type expression (`string`), `description` text: only `default` matters.
        let default = match b.body.attributes().find(|a| a.key.as_str() == "default") {
            Some(a) => Some(
                match crate::hcl_value::expr_to_json(&format!("{ctx}.default"), &a.expr)? {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                },
            ),
            None => None,
        };
        declared.insert(name, default);
    }
    let set: Body = hcl::parse(var_file)?;
    for a in set.attributes() {
        let name = a.key.as_str();
        let slot = declared.get_mut(name).ok_or_else(|| {
            HclError::Invalid(
                format!("variable.{name}"),
                "Undefined -var variable: a variable set must be declared in the jobspec".into(),
            )
        })?;
        let v = crate::hcl_value::expr_to_json(name, &a.expr)?;
        *slot = Some(match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        });
    }
    declared
        .into_iter()
        .map(|(k, v)| {
            v.map(|v| (k.clone(), v)).ok_or_else(|| {
                HclError::Invalid(
                    format!("variable.{k}"),
                    "Unset variable: a used variable must be set or have a default value".into(),
                )
            })
        })
        .collect()
}

fn substitute_body(body: &mut Body, vars: &BTreeMap<String, String>) -> Result<(), HclError> {
    for s in body.0.iter_mut() {
        match s {
            hcl::Structure::Attribute(a) => substitute(&mut a.expr, vars)?,
            hcl::Structure::Block(b) => substitute_body(&mut b.body, vars)?,
        }
    }
    Ok(())
}

/// Replaces `var.<name>` (an expression) and `${var.<name>}` (in a string) by the value.
fn substitute(e: &mut hcl::Expression, vars: &BTreeMap<String, String>) -> Result<(), HclError> {
    use hcl::{Expression, TemplateExpr, TraversalOperator};
    let undeclared = |name: &str| {
        HclError::Invalid(
            format!("var.{name}"),
            "Reference to undeclared input variable".into(),
        )
    };
    match e {
        Expression::Traversal(t) => {
            if let (Expression::Variable(root), [TraversalOperator::GetAttr(name)]) =
                (&t.expr, t.operators.as_slice())
            {
                if root.as_str() == "var" {
                    let v = vars
                        .get(name.as_str())
                        .ok_or_else(|| undeclared(name.as_str()))?;
                    *e = Expression::String(v.clone());
                }
            }
        }
        Expression::TemplateExpr(t) => {
            let (text, quoted) = match t.as_mut() {
                TemplateExpr::QuotedString(s) => (s, true),
                TemplateExpr::Heredoc(h) => (&mut h.template, false),
            };
            let mut out = String::with_capacity(text.len());
            let mut rest = text.as_str();
            while let Some(at) = rest.find("${var.") {
                let end = rest[at..]
                    .find('}')
                    .map(|i| at + i)
                    .ok_or_else(|| undeclared(&rest[at..]))?;
                let name = &rest[at + "${var.".len()..end];
                let v = vars.get(name).ok_or_else(|| undeclared(name))?;
                out.push_str(&rest[..at]);
                if quoted {
                    out.push_str(&v.replace('\\', "\\\\").replace('"', "\\\""));
                } else {
                    out.push_str(v);
                }
                rest = &rest[end + 1..];
            }
            out.push_str(rest);
            *text = out;
        }
        Expression::Array(a) => {
            for x in a {
                substitute(x, vars)?;
            }
        }
        Expression::Object(o) => {
            for x in o.values_mut() {
                substitute(x, vars)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn constraints(ctx: &str, body: &Body) -> Result<Option<Vec<Constraint>>, HclError> {
    let mut out = Vec::new();
    for b in body
        .blocks()
        .filter(|b| b.identifier.as_str() == "constraint")
    {
        let attrs = attributes(ctx, &b.body)?;
        let a = Attrs::new(&format!("{ctx}.constraint"), &attrs);
        let mut c = Constraint {
            LTarget: a.str("attribute")?.unwrap_or_default(),
            RTarget: a.str("value")?.unwrap_or_default(),
            Operand: a.str("operator")?.unwrap_or_else(|| "=".into()),
        };
        for special in [
            "distinct_hosts",
            "distinct_property",
            "regexp",
            "version",
            "semver",
            "set_contains",
            "set_contains_any",
            "is_set",
            "is_not_set",
        ] {
            if let Some(v) = attrs.get(special) {
                c.Operand = special.into();
                if special == "distinct_property" {
                    c.LTarget = v.as_str().unwrap_or_default().into();
                } else if c.RTarget.is_empty() {
                    c.RTarget = match v {
                        serde_json::Value::String(s) => s.clone(),
                        o => o.to_string(),
                    };
                }
            }
        }
        out.push(c);
    }
    Ok((!out.is_empty()).then_some(out))
}

/// An `update` block as the fields it sets (Go names; durations in ns); `Null` when absent.
fn update(ctx: &str, body: &Body) -> Result<serde_json::Value, HclError> {
    let Some(b) = body.blocks().find(|b| b.identifier.as_str() == "update") else {
        return Ok(serde_json::Value::Null);
    };
    let attrs = attributes(ctx, &b.body)?;
    let a = Attrs::new(&format!("{ctx}.update"), &attrs);
    let mut out = serde_json::Map::new();
    for (key, name) in [("max_parallel", "MaxParallel"), ("canary", "Canary")] {
        if let Some(v) = a.int(key)? {
            out.insert(name.into(), v.into());
        }
    }
    for (key, name) in [
        ("auto_promote", "AutoPromote"),
        ("auto_revert", "AutoRevert"),
    ] {
        if let Some(v) = a.bool(key)? {
            out.insert(name.into(), v.into());
        }
    }
    if let Some(v) = a.str("health_check")? {
        out.insert("HealthCheck".into(), v.into());
    }
    for (key, name) in [
        ("min_healthy_time", "MinHealthyTime"),
        ("healthy_deadline", "HealthyDeadline"),
        ("progress_deadline", "ProgressDeadline"),
        ("stagger", "Stagger"),
    ] {
        if let Some(v) = a.duration_ns(key)? {
            out.insert(name.into(), v.into());
        }
    }
    Ok(serde_json::Value::Object(out))
}

/// A group's `disconnect` block (lost_after, replace, reconcile, stop_on_client_after) as
/// Nomad's `DisconnectStrategy` JSON; `Null` when absent.
fn disconnect(ctx: &str, body: &Body) -> Result<serde_json::Value, HclError> {
    let Some(b) = body
        .blocks()
        .find(|b| b.identifier.as_str() == "disconnect")
    else {
        return Ok(serde_json::Value::Null);
    };
    let attrs = attributes(ctx, &b.body)?;
    let a = Attrs::new(&format!("{ctx}.disconnect"), &attrs);
    let mut out = serde_json::Map::new();
    if let Some(v) = a.duration_ns("lost_after")? {
        out.insert("LostAfter".into(), v.into());
    }
    if let Some(v) = a.bool("replace")? {
        out.insert("Replace".into(), v.into());
    }
    if let Some(v) = a.str("reconcile")? {
        if ![
            "best_score",
            "keep_original",
            "keep_replacement",
            "longest_running",
        ]
        .contains(&v.as_str())
        {
            return Err(HclError::Invalid(
                format!("{ctx}.disconnect.reconcile"),
                format!("invalid reconcile option {v:?}"),
            ));
        }
        out.insert("Reconcile".into(), v.into());
    }
    if let Some(v) = a.duration_ns("stop_on_client_after")? {
        out.insert("StopOnClientAfter".into(), v.into());
    }
    Ok(serde_json::Value::Object(out))
}

fn restart_policy(ctx: &str, body: &Body) -> Result<Option<RestartPolicy>, HclError> {
    let Some(b) = body.blocks().find(|b| b.identifier.as_str() == "restart") else {
        return Ok(None);
    };
    let attrs = attributes(ctx, &b.body)?;
    let a = Attrs::new(&format!("{ctx}.restart"), &attrs);
    Ok(Some(RestartPolicy {
        Attempts: a.int("attempts")?.unwrap_or(RestartPolicy::UNSET),
        Interval: a.duration_ns("interval")?.unwrap_or(RestartPolicy::UNSET),
        Delay: a.duration_ns("delay")?.unwrap_or(RestartPolicy::UNSET),
        Mode: a.str("mode")?.unwrap_or_default(),
        RenderTemplates: a.bool("render_templates")?.unwrap_or(false),
    }))
}

/// A group's `network` blocks as Nomad's `[]*NetworkResource` (`Mode`, `ReservedPorts` for
/// ports with `static`, `DynamicPorts` for the others, each `{Label, Value, To,
/// HostNetwork}`); `null` when there is none. Other network settings are not modelled.
fn networks(ctx: &str, body: &hcl::Body) -> Result<serde_json::Value, HclError> {
    let mut out = Vec::new();
    for n in body.blocks().filter(|b| b.identifier.as_str() == "network") {
        let nctx = format!("{ctx}.network");
        let attrs = attributes(&nctx, &n.body)?;
        let na = Attrs::new(&nctx, &attrs);
        let (mut reserved, mut dynamic) = (Vec::new(), Vec::new());
        for p in n.body.blocks().filter(|b| b.identifier.as_str() == "port") {
            let l = label(p, 0)
                .ok_or_else(|| HclError::Invalid(nctx.clone(), "port without label".into()))?;
            let pctx = format!("{nctx}.port.{l}");
            let attrs = attributes(&pctx, &p.body)?;
            let pa = Attrs::new(&pctx, &attrs);
            let stat = pa.int("static")?.unwrap_or(0);
            let port = serde_json::json!({
                "Label": l,
                "Value": stat,
                "To": pa.int("to")?.unwrap_or(0),
                "HostNetwork": pa.str("host_network")?.unwrap_or_else(|| "default".into()),
            });
            if stat > 0 {
                reserved.push(port);
            } else {
                dynamic.push(port);
            }
        }
        out.push(serde_json::json!({
            "Mode": na.str("mode")?.unwrap_or_else(|| "host".into()),
            "ReservedPorts": reserved,
            "DynamicPorts": dynamic,
        }));
    }
    Ok(if out.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::Value::Array(out)
    })
}

fn parse_group(job_ctx: &str, g: &hcl::Block) -> Result<TaskGroup, HclError> {
    let name = label(g, 0)
        .ok_or_else(|| HclError::Invalid(job_ctx.into(), "group without name".into()))?;
    let ctx = format!("{job_ctx}.group.{name}");
    let attrs = attributes(&ctx, &g.body)?;
    let a = Attrs::new(&ctx, &attrs);
    let mut tg = TaskGroup {
        Name: name,
        Count: a.int("count")?.unwrap_or(0),
        Constraints: constraints(&ctx, &g.body)?,
        RestartPolicy: restart_policy(&ctx, &g.body)?,
        Meta: map_attr_or_block(&ctx, &g.body, "meta")?,
        ShutdownDelay: a.duration_ns("shutdown_delay")?,
        Update: update(&ctx, &g.body)?,
        MaxClientDisconnect: a.duration_ns("max_client_disconnect")?,
        StopAfterClientDisconnect: a.duration_ns("stop_after_client_disconnect")?,
        Disconnect: disconnect(&ctx, &g.body)?,
        ..Default::default()
    };
    if let Some(b) = g
        .body
        .blocks()
        .find(|b| b.identifier.as_str() == "reschedule")
    {
        let attrs = attributes(&ctx, &b.body)?;
        let r = Attrs::new(&format!("{ctx}.reschedule"), &attrs);
        tg.ReschedulePolicy = Some(ReschedulePolicy {
            Attempts: r.int("attempts")?.unwrap_or(0),
            Interval: r.duration_ns("interval")?.unwrap_or(0),
            Delay: r.duration_ns("delay")?.unwrap_or(0),
            DelayFunction: r.str("delay_function")?.unwrap_or_default(),
            MaxDelay: r.duration_ns("max_delay")?.unwrap_or(0),
            Unlimited: r.bool("unlimited")?.unwrap_or(false),
        });
    }
    let mut vols = BTreeMap::new();
    for v in g
        .body
        .blocks()
        .filter(|b| b.identifier.as_str() == "volume")
    {
        let alias = label(v, 0)
            .ok_or_else(|| HclError::Invalid(ctx.clone(), "volume without name".into()))?;
        let vctx = format!("{ctx}.volume.{alias}");
        let attrs = attributes(&vctx, &v.body)?;
        let va = Attrs::new(&vctx, &attrs);
        vols.insert(
            alias.clone(),
            VolumeRequest {
                Name: alias,
                Type: va.str("type")?.unwrap_or_default(),
                Source: va.str("source")?.unwrap_or_default(),
                ReadOnly: va.bool("read_only")?.unwrap_or(false),
                Sticky: va.bool("sticky")?.unwrap_or(false),
                AccessMode: va.str("access_mode")?.unwrap_or_default(),
                AttachmentMode: va.str("attachment_mode")?.unwrap_or_default(),
                MountOptions: serde_json::Value::Null,
                PerAlloc: va.bool("per_alloc")?.unwrap_or(false),
            },
        );
    }
    if !vols.is_empty() {
        tg.Volumes = Some(vols);
    }
    tg.Networks = networks(&ctx, &g.body)?;
    for t in g.body.blocks().filter(|b| b.identifier.as_str() == "task") {
        tg.Tasks.push(parse_task(&ctx, t)?);
    }
    Ok(tg)
}

fn parse_task(group_ctx: &str, t: &hcl::Block) -> Result<Task, HclError> {
    let name = label(t, 0)
        .ok_or_else(|| HclError::Invalid(group_ctx.into(), "task without name".into()))?;
    let ctx = format!("{group_ctx}.task.{name}");
    let attrs = attributes(&ctx, &t.body)?;
    let a = Attrs::new(&ctx, &attrs);
    let mut task = Task {
        Name: name,
        Driver: a.str("driver")?.unwrap_or_default(),
        User: a.str("user")?.unwrap_or_default(),
        Env: map_attr_or_block(&ctx, &t.body, "env")?,
        Meta: map_attr_or_block(&ctx, &t.body, "meta")?,
        KillTimeout: a.duration_ns("kill_timeout")?.unwrap_or(0),
        KillSignal: a.str("kill_signal")?.unwrap_or_default(),
        ShutdownDelay: a.duration_ns("shutdown_delay")?.unwrap_or(0),
        Leader: a.bool("leader")?.unwrap_or(false),
        RestartPolicy: restart_policy(&ctx, &t.body)?,
        Constraints: constraints(&ctx, &t.body)?,
        ..Default::default()
    };
    for b in t.body.blocks() {
        let bctx = format!("{ctx}.{}", b.identifier);
        match b.identifier.as_str() {
            "config" => task.Config = attributes(&bctx, &b.body)?,
            "lifecycle" => {
                let attrs = attributes(&bctx, &b.body)?;
                let la = Attrs::new(&bctx, &attrs);
                task.Lifecycle = Some(Lifecycle {
                    Hook: la.str("hook")?.unwrap_or_default(),
                    Sidecar: la.bool("sidecar")?.unwrap_or(false),
                });
            }
            "volume_mount" => {
                let attrs = attributes(&bctx, &b.body)?;
                let va = Attrs::new(&bctx, &attrs);
                task.VolumeMounts
                    .get_or_insert_with(Vec::new)
                    .push(VolumeMount {
                        Volume: va.str("volume")?.unwrap_or_default(),
                        Destination: va.str("destination")?.unwrap_or_default(),
                        ReadOnly: va.bool("read_only")?.unwrap_or(false),
                        PropagationMode: va.str("propagation_mode")?.unwrap_or_default(),
                        SELinuxLabel: va.str("selinux_label")?.unwrap_or_default(),
                    });
            }
            "identity" => {
                let attrs = attributes(&bctx, &b.body)?;
                let ia = Attrs::new(&bctx, &attrs);
                let ident = WorkloadIdentity {
                    Name: label(b, 0).unwrap_or_default(),
                    Audience: ia.strings("aud")?.unwrap_or_default(),
                    ChangeMode: ia.str("change_mode")?.unwrap_or_default(),
                    ChangeSignal: ia.str("change_signal")?.unwrap_or_default(),
                    Env: ia.bool("env")?.unwrap_or(false),
                    File: ia.bool("file")?.unwrap_or(false),
                    Filepath: ia.str("filepath")?.unwrap_or_default(),
                    TTL: ia.duration_ns("ttl")?.unwrap_or(0),
                    ..Default::default()
                };
                if ident.Name.is_empty() || ident.Name == "default" {
                    task.Identity = Some(ident);
                } else {
                    task.Identities.get_or_insert_with(Vec::new).push(ident);
                }
            }
            "artifact" => {
                let attrs = attributes(&bctx, &b.body)?;
                let aa = Attrs::new(&bctx, &attrs);
                let mut checksum = None;
                for o in b
                    .body
                    .blocks()
                    .filter(|o| o.identifier.as_str() == "options")
                {
                    let octx = format!("{bctx}.options");
                    let oattrs = attributes(&octx, &o.body)?;
                    checksum = Attrs::new(&octx, &oattrs).str("checksum")?;
                }
                let a = crate::artifact::Artifact {
                    source: aa.str("source")?.ok_or_else(|| {
                        HclError::Invalid(bctx.clone(), "artifact without source".into())
                    })?,
                    checksum,
                    destination: aa.str("destination")?.unwrap_or_else(|| "local/".into()),
                };
                match &mut task.Artifacts {
                    serde_json::Value::Array(list) => list.push(a.to_json()),
                    other => *other = serde_json::Value::Array(vec![a.to_json()]),
                }
            }
            "resources" => {
                let attrs = attributes(&bctx, &b.body)?;
                let ra = Attrs::new(&bctx, &attrs);
                let d = Resources::default();
                task.Resources = Resources {
                    CPU: ra.int("cpu")?.unwrap_or(d.CPU),
                    Cores: ra.int("cores")?.unwrap_or(0),
                    MemoryMB: ra.int("memory")?.unwrap_or(d.MemoryMB),
                    MemoryMaxMB: ra.int("memory_max")?.unwrap_or(0),
                    ..d
                };
            }
            _ => {}
        }
    }
    Ok(task)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repository's system job: its variables' defaults, then `-var`-style settings,
    /// reach the artifact block (a bare `var.x` and a `${var.x}` inside a string).
    #[test]
    fn group_network_ports_are_reserved_or_dynamic() {
        let job = parse(
            r#"job "j" {
  group "g" {
    network {
      port "metrics" {
        static = 9464
      }
      port "http" {
        to = 8080
      }
    }
    task "t" {
      driver = "raw_exec"
    }
  }
}"#,
        )
        .unwrap();
        let n = &job.TaskGroups[0].Networks[0];
        assert_eq!(n["Mode"], "host");
        assert_eq!(n["ReservedPorts"][0]["Label"], "metrics");
        assert_eq!(n["ReservedPorts"][0]["Value"], 9464);
        assert_eq!(n["DynamicPorts"][0]["Label"], "http");
        assert_eq!(n["DynamicPorts"][0]["To"], 8080);
    }

    #[test]
    fn the_system_jobs_variables_are_set_from_defaults_and_overrides() {
        let src = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../jobspecs/dhv-binder.nomad.hcl"),
        )
        .unwrap();
        let artifact = |job: &Job| job.TaskGroups[0].Tasks[0].Artifacts[0].clone();
        let a = artifact(&parse(&src).unwrap());
        assert!(
            a["GetterSource"].as_str().unwrap().starts_with("https://"),
            "{a}"
        );
        assert_eq!(
            a["GetterOptions"]["checksum"],
            format!("sha256:{}", "0".repeat(64))
        );
        let sha = "ab".repeat(32);
        let job = parse_with_variables(
            &src,
            &format!("release_url = \"http://127.0.0.1:1/r.tar.gz\"\nrelease_sha256 = \"{sha}\"\n"),
        )
        .unwrap();
        let a = artifact(&job);
        assert_eq!(a["GetterSource"], "http://127.0.0.1:1/r.tar.gz");
        assert_eq!(a["GetterOptions"]["checksum"], format!("sha256:{sha}"));
        assert_eq!(a["RelativeDest"], "local/");
        // Runtime interpolations stay for the client.
        assert!(serde_json::to_string(&job)
            .unwrap()
            .contains("${NOMAD_SECRETS_DIR}"));
        let err = parse_with_variables(&src, "nope = \"x\"").unwrap_err();
        assert!(err.to_string().contains("Undefined -var variable"), "{err}");
        let err =
            parse("variable \"a\" {}\njob \"j\" {\n  meta {\n    x = var.a\n  }\n}\n").unwrap_err();
        assert!(err.to_string().contains("Unset variable"), "{err}");
        let err = parse("job \"j\" {\n  meta {\n    x = \"${var.b}\"\n  }\n}\n").unwrap_err();
        assert!(
            err.to_string().contains("undeclared input variable"),
            "{err}"
        );
    }

    #[test]
    fn parses_and_canonicalizes() {
        let src = r#"
job "orders" {
  group "app" {
    count = 2
    volume "data" {
      type = "host"
      source = "orders-data"
      access_mode = "single-node-writer"
      attachment_mode = "file-system"
    }
    task "wait" {
      driver = "exec"
      lifecycle { hook = "prestart" }
      config {
        command = "/bin/sh"
        args = ["-c", "echo ${NOMAD_ALLOC_ID}"]
      }
      identity { env = true }
      kill_timeout = "2s"
    }
    task "server" {
      driver = "exec"
      env { A = "b" }
      volume_mount {
        volume = "data"
        destination = "/srv/data"
      }
    }
  }
}"#;
        let mut job = parse(src).unwrap();
        job.canonicalize("global");
        assert_eq!(job.Namespace, "default");
        assert_eq!(job.Datacenters, vec!["*".to_string()]);
        let g = &job.TaskGroups[0];
        assert_eq!(g.Count, 2);
        assert_eq!(g.Volumes.as_ref().unwrap()["data"].Source, "orders-data");
        assert_eq!(g.Tasks[0].KillTimeout, 2_000_000_000);
        assert_eq!(g.Tasks[1].KillTimeout, 5_000_000_000);
        assert!(g.Tasks[0].is_ephemeral_prestart());
        assert!(g.Tasks[1].Lifecycle.is_none());
        assert_eq!(
            g.Tasks[0].Config["args"][1].as_str().unwrap(),
            "echo ${NOMAD_ALLOC_ID}"
        );
        assert_eq!(g.Tasks[1].Env.as_ref().unwrap()["A"], "b");
        assert!(g.Tasks[0].Identity.as_ref().unwrap().Env);
        assert_eq!(
            g.Tasks[1].VolumeMounts.as_ref().unwrap()[0].PropagationMode,
            "private"
        );
    }

    /// `restart` blocks merge field by field: the group's set fields over the job type's
    /// default, a task's set fields over its group's (`api/tasks.go` `RestartPolicy.Merge`,
    /// `TaskGroup.Canonicalize`, `Task.Canonicalize`); a task without one takes its group's.
    #[test]
    fn restart_blocks_merge_field_by_field() {
        let src = r#"
job "r" {
  group "g" {
    restart {
      attempts = 1
    }
    task "a" {
      driver = "raw_exec"
      restart {
        delay = "2s"
        mode  = "delay"
      }
      config { command = "/bin/true" }
    }
    task "b" {
      driver = "raw_exec"
      config { command = "/bin/true" }
    }
  }
}"#;
        let mut job = parse(src).unwrap();
        job.canonicalize("global");
        let g = &job.TaskGroups[0];
        let s = 1_000_000_000i64;
        let group = g.RestartPolicy.clone().unwrap();
        assert_eq!(
            (
                group.Attempts,
                group.Interval,
                group.Delay,
                group.Mode.as_str()
            ),
            (1, 1800 * s, 15 * s, "fail"),
            "the group's attempts over the service default"
        );
        let a = g.Tasks[0].RestartPolicy.clone().unwrap();
        assert_eq!(
            (a.Attempts, a.Interval, a.Delay, a.Mode.as_str()),
            (1, 1800 * s, 2 * s, "delay"),
            "the task's delay and mode over the group's"
        );
        assert_eq!(g.Tasks[1].RestartPolicy.as_ref(), Some(&group));
    }
}
