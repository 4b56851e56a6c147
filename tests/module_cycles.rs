//! No import cycles in `src/` and `sim/src/` (the simulator crate), at two levels:
//! - the **layers**: the top-level modules (a folder such as `src/nomad/` or a file such as
//!   `src/config.rs`) must import each other without a cycle, so each folder uses only the
//!   layers below it (lib.rs lists them in that order);
//! - the **modules**: every file is a module (`cli/storage.rs` is `cli::storage`), and no two
//!   modules may import each other, even inside one folder.
//!
//! A module's imports are its `crate::…`, `super::…` and `self::…` paths (in `use` lines and
//! in code, comments and `#[cfg(test)]` code excluded), each resolved to the longest module
//! path it names. A reference to an ancestor (`super::Failure` from `cli/storage.rs` names
//! `cli`) counts as an import of that ancestor's own file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `cli/storage.rs` → `["cli", "storage"]`; `cli/mod.rs` → `["cli"]`; `lib.rs` → `[]`.
fn module_of(path: &Path, src: &Path) -> Vec<String> {
    let rel = path.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !(stem == "mod" || (parts.is_empty() && (stem == "lib" || stem == "main"))) {
        parts.push(stem.to_string());
    }
    parts
}

/// The code of a file that counts: before `#[cfg(test)]`, without comment lines.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap().to_string();
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths a piece of code names after `prefix` (`crate::`, `super::`, `self::`), each as
/// its segments: `crate::a::b::{c, d::e}` gives `[a, b, c]` and `[a, b, d, e]`.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices(prefix) {
        // `super::super::x` is read from its first `super::`; skip the inner ones.
        if prefix == "super::" && code[..i].ends_with("super::") {
            continue;
        }
        if i > 0 {
            let before = code[..i].chars().next_back().unwrap();
            if before.is_alphanumeric() || before == '_' {
                continue;
            }
        }
        let mut base: Vec<String> = Vec::new();
        let mut rest = &code[i + prefix.len()..];
        if prefix == "super::" {
            base.push("super".into());
            while let Some(r) = rest.strip_prefix("super::") {
                base.push("super".into());
                rest = r;
            }
        }
        expand(rest, base, &mut out);
    }
    out
}

/// Reads one path (or `{…}` group) from the start of `rest`, appending to `base`.
fn expand(rest: &str, mut base: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut rest = rest;
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut end = 0;
            for (k, ch) in group.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = k;
                    break;
                }
            }
            let inner = &group[..end];
            let mut depth = 0;
            let mut start = 0;
            for (k, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(inner[start..k].trim_start(), base.clone(), out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            expand(inner[start..].trim_start(), base.clone(), out);
            return;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            break;
        }
        base.push(name.clone());
        rest = &rest[name.len()..];
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => break,
        }
    }
    if !base.is_empty() {
        out.push(base);
    }
}

/// The longest module in `modules` that `path` (absolute segments) names; `[]` is the crate.
fn resolve(path: &[String], modules: &BTreeSet<Vec<String>>) -> Vec<String> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
        .unwrap_or_default()
}

/// Module (its path joined with `::`) → the modules it imports.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut all = Vec::new();
    files(src, &mut all);
    let modules: BTreeSet<Vec<String>> = all.iter().map(|f| module_of(f, src)).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &all {
        let me = module_of(f, src);
        if me.is_empty() {
            continue; // lib.rs / main.rs: the crate root declares every module
        }
        let code = code(f);
        let mut refs: Vec<Vec<String>> = paths_after(&code, "crate::");
        for p in paths_after(&code, "self::") {
            refs.push(me.iter().cloned().chain(p).collect());
        }
        for p in paths_after(&code, "super::") {
            let ups = p.iter().take_while(|s| *s == "super").count();
            // In `a/b.rs` (module a::b) `super` is `a`; in `a/mod.rs` (module a) it is the
            // crate root, as for a file `a.rs`.
            let keep = me.len().saturating_sub(ups);
            refs.push(
                me[..keep]
                    .iter()
                    .cloned()
                    .chain(p[ups..].iter().cloned())
                    .collect(),
            );
        }
        let deps = g.entry(me.join("::")).or_default();
        for r in refs {
            let target = resolve(&r, &modules);
            if !target.is_empty() && target != me && !me.starts_with(&target) {
                deps.insert(target.join("::"));
            }
        }
    }
    g
}

/// Top-level module → the top-level modules it imports.
fn layer_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &str| m.split("::").next().unwrap().to_string();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, deps) in module_graph(src) {
        let t = top(&m);
        let entry = g.entry(t.clone()).or_default();
        for d in deps {
            if top(&d) != t {
                entry.insert(top(&d));
            }
        }
    }
    g
}

fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| s == n) {
            let mut c = stack[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for n in g.keys() {
        if let Some(c) = visit(n, g, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

fn assert_acyclic(dir: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let layers = layer_graph(&src);
    assert!(
        layers.len() > 10,
        "the layer graph was not read: {layers:?}"
    );
    if let Some(c) = find_cycle(&layers) {
        panic!(
            "import cycle between the layers of {dir}/: {}",
            c.join(" -> ")
        );
    }
    let modules = module_graph(&src);
    if let Some(c) = find_cycle(&modules) {
        panic!(
            "import cycle between the modules of {dir}/: {}",
            c.join(" -> ")
        );
    }
}

#[test]
fn the_layers_and_modules_of_src_import_each_other_without_cycles() {
    assert_acyclic("src");
}

#[test]
fn the_layers_and_modules_of_the_simulator_import_each_other_without_cycles() {
    assert_acyclic("sim/src");
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("config", &["watch"][..]),
        ("watch", &["nomad"]),
        ("nomad", &["config"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
    .collect();
    assert!(find_cycle(&g).is_some());
}

/// Two sibling modules of one folder that use each other through `super::` are a cycle, as
/// `cli/storage.rs` and `cli/volume.rs` were.
#[test]
fn a_cycle_inside_a_folder_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("cli")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod cli;\n").unwrap();
    std::fs::write(
        src.join("cli/mod.rs"),
        "pub mod storage;\npub mod volume;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("cli/storage.rs"),
        "use super::volume::{read_record, SigningArgs};\n",
    )
    .unwrap();
    std::fs::write(
        src.join("cli/volume.rs"),
        "use super::{output::table, storage::{self, LocalPlugins}};\n",
    )
    .unwrap();
    let g = module_graph(src);
    assert_eq!(
        g["cli::storage"],
        BTreeSet::from(["cli::volume".to_string()])
    );
    assert!(g["cli::volume"].contains("cli::storage"), "{g:?}");
    assert!(find_cycle(&g).is_some(), "{g:?}");
    // A layer has no cycle with itself.
    assert!(find_cycle(&layer_graph(src)).is_none());
}

/// Paths are resolved to the longest module they name, through groups and `super::super`.
#[test]
fn paths_resolve_to_the_longest_module() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    for d in ["node/mounts", "agent"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    for (f, text) in [
        ("lib.rs", ""),
        ("config.rs", ""),
        ("node/mod.rs", ""),
        ("node/mounts/mod.rs", ""),
        ("node/mounts/busy.rs", "use super::super::host::Foo;\n"),
        ("node/host.rs", "use crate::config::X;\n"),
        (
            "agent/core.rs",
            "use crate::{config, node::{mounts::busy::Y, host}};\nfn f() { super::shell::g() }\n",
        ),
        ("agent/shell.rs", ""),
    ] {
        std::fs::write(src.join(f), text).unwrap();
    }
    let g = module_graph(src);
    assert_eq!(
        g["node::mounts::busy"],
        BTreeSet::from(["node::host".to_string()])
    );
    assert_eq!(
        g["agent::core"],
        ["agent::shell", "config", "node::host", "node::mounts::busy"]
            .into_iter()
            .map(String::from)
            .collect::<BTreeSet<_>>()
    );
    assert_eq!(
        layer_graph(src)["agent"],
        BTreeSet::from(["config".to_string(), "node".to_string()])
    );
}
