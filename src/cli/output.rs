//! How read commands print: a readable Nomad-style form (aligned `Key = value` blocks and
//! column tables, as `nomad volume status` prints them), `-json` for machines, and `-t` with
//! a small Go-template-like format (`{{.Field}}`, `{{range .List}}…{{end}}`).

use super::{Failure, EXIT_CONFIG};
use crate::escape::escape_control;
use serde::Serialize;

/// The output flags every read command takes.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OutputArgs {
    /// Print the full answer as JSON instead of the readable summary (`-json` works too).
    #[arg(long = "json", conflicts_with = "template")]
    pub json: bool,
    /// Format the JSON answer with a template: `{{.Field.Sub}}` prints a value,
    /// `{{range .List}}…{{end}}` repeats for each element (`.` is the element).
    #[arg(short = 't', long = "template")]
    pub template: Option<String>,
    /// Full IDs instead of their first 8 characters, and more detail.
    #[arg(long = "verbose")]
    pub verbose: bool,
}

impl OutputArgs {
    /// Renders `value`: as pretty JSON, through the template, or with `human`.
    pub fn render<T: Serialize>(
        &self,
        value: &T,
        human: impl FnOnce(&T) -> String,
    ) -> Result<String, Failure> {
        if self.json {
            let mut s = serde_json::to_string_pretty(value)
                .map_err(|e| Failure::new(super::EXIT_FAILED, e.to_string()))?;
            s.push('\n');
            return Ok(s);
        }
        if let Some(t) = &self.template {
            let v = serde_json::to_value(value)
                .map_err(|e| Failure::new(super::EXIT_FAILED, e.to_string()))?;
            return template(t, &v).map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()));
        }
        Ok(human(value))
    }

    /// Renders and prints (see [`OutputArgs::render`]).
    pub fn print<T: Serialize>(
        &self,
        value: &T,
        human: impl FnOnce(&T) -> String,
    ) -> Result<(), Failure> {
        let s = self.render(value, human)?;
        print_raw(&s);
        Ok(())
    }
}

/// Writes `s` to stdout as is; a closed pipe ends the process quietly.
pub fn print_raw(s: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    if out
        .write_all(s.as_bytes())
        .and_then(|_| out.flush())
        .is_err()
    {
        std::process::exit(0);
    }
}

/// An aligned `Key = value` block (keys padded to the longest), one row a line. Values are
/// terminal-escaped ([`escape_control`]): they come from records, plugins and Nomad.
pub fn kv(rows: &[(&str, String)]) -> String {
    let width = rows
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    let mut s = String::new();
    for (k, v) in rows {
        let v = escape_control(v);
        s.push_str(&format!("{k:<width$} = {v}\n"));
    }
    s
}

/// A table: a header row and rows, columns padded to their widest cell and separated by
/// two spaces, trailing spaces trimmed. No rows prints `empty` instead of the header. Cells
/// are terminal-escaped ([`escape_control`]).
pub fn table(header: &[&str], rows: &[Vec<String>], empty: &str) -> String {
    if rows.is_empty() {
        return format!("{empty}\n");
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| escape_control(c)).collect())
        .collect();
    let rows = rows.as_slice();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| -> String {
        let mut s = String::new();
        for (i, c) in cells.enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            s.push_str(&format!("{c:<w$}  "));
        }
        let mut s = s.trim_end().to_string();
        s.push('\n');
        s
    };
    let mut s = line(&mut header.iter().copied());
    for r in rows {
        s.push_str(&line(&mut r.iter().map(String::as_str)));
    }
    s
}

/// A byte count as Nomad prints capacity (binary units): `1073741824` is `1.0 GiB`.
pub fn bytes(n: u64) -> String {
    bytesize::ByteSize(n).to_string_as(true)
}

/// An ID as tables print it: its first 8 characters (Nomad's short IDs), in full with
/// `verbose`.
pub fn short_id(id: &str, verbose: bool) -> String {
    if verbose {
        id.to_string()
    } else {
        id.chars().take(8).collect()
    }
}

/// A duration in the past as `12s ago`, `3m4s ago`; `never` for 0 (no timestamp).
pub fn ago(then_unix_secs: u64, now_unix_secs: u64) -> String {
    if then_unix_secs == 0 {
        return "never".into();
    }
    let d = now_unix_secs.saturating_sub(then_unix_secs);
    let d = humantime::format_duration(std::time::Duration::from_secs(d)).to_string();
    format!("{} ago", d.replace(' ', ""))
}

/// Seconds since the Unix epoch now.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A template that cannot be rendered.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TemplateError {
    #[error("template: unclosed {{{{ at byte {0}")]
    Unclosed(usize),
    #[error("template: {{{{{0}}}}} is not supported (use {{{{.Field}}}}, {{{{range .List}}}} and {{{{end}}}})")]
    Unsupported(String),
    #[error("template: {{{{range}}}} without {{{{end}}}}")]
    UnendedRange,
    #[error("template: {{{{end}}}} without {{{{range}}}}")]
    StrayEnd,
}

#[derive(Debug)]
enum Node {
    Text(String),
    Field(Vec<String>),
    Range(Vec<String>, Vec<Node>),
}

fn path_of(expr: &str) -> Option<Vec<String>> {
    let e = expr.trim();
    if e == "." {
        return Some(Vec::new());
    }
    let rest = e.strip_prefix('.')?;
    let parts: Vec<String> = rest.split('.').map(str::to_string).collect();
    parts
        .iter()
        .all(|p| !p.is_empty() && p.chars().all(|c| c.is_alphanumeric() || c == '_'))
        .then_some(parts)
}

fn parse(t: &str) -> Result<Vec<Node>, TemplateError> {
    let mut stack: Vec<(Vec<String>, Vec<Node>)> = Vec::new();
    let mut cur: Vec<Node> = Vec::new();
    let mut pos = 0;
    while let Some(open) = t[pos..].find("{{") {
        let start = pos + open;
        if start > pos {
            cur.push(Node::Text(t[pos..start].to_string()));
        }
        let close = t[start..]
            .find("}}")
            .ok_or(TemplateError::Unclosed(start))?;
        let action = t[start + 2..start + close].trim();
        pos = start + close + 2;
        if let Some(r) = action.strip_prefix("range ") {
            let p = path_of(r).ok_or_else(|| TemplateError::Unsupported(action.into()))?;
            stack.push((p, std::mem::take(&mut cur)));
        } else if action == "end" {
            let (p, outer) = stack.pop().ok_or(TemplateError::StrayEnd)?;
            let body = std::mem::replace(&mut cur, outer);
            cur.push(Node::Range(p, body));
        } else {
            let p = path_of(action).ok_or_else(|| TemplateError::Unsupported(action.into()))?;
            cur.push(Node::Field(p));
        }
    }
    if !stack.is_empty() {
        return Err(TemplateError::UnendedRange);
    }
    if pos < t.len() {
        cur.push(Node::Text(t[pos..].to_string()));
    }
    Ok(cur)
}

fn lookup<'a>(v: &'a serde_json::Value, path: &[String]) -> &'a serde_json::Value {
    path.iter()
        .fold(v, |v, p| v.get(p).unwrap_or(&serde_json::Value::Null))
}

fn eval(nodes: &[Node], v: &serde_json::Value, out: &mut String) {
    for n in nodes {
        match n {
            Node::Text(s) => out.push_str(s),
            Node::Field(p) => match lookup(v, p) {
                serde_json::Value::String(s) => out.push_str(s),
                serde_json::Value::Null => out.push_str("<no value>"),
                other => out.push_str(&other.to_string()),
            },
            Node::Range(p, body) => match lookup(v, p) {
                serde_json::Value::Array(items) => {
                    for i in items {
                        eval(body, i, out);
                    }
                }
                serde_json::Value::Object(m) => {
                    for i in m.values() {
                        eval(body, i, out);
                    }
                }
                _ => {}
            },
        }
    }
}

/// Renders a template over a JSON value (the `-json` form of the same command). Missing
/// fields print `<no value>`, as Go's templates do; `\n` and `\t` escapes are honoured.
pub fn template(t: &str, v: &serde_json::Value) -> Result<String, TemplateError> {
    let t = t.replace("\\n", "\n").replace("\\t", "\t");
    let nodes = parse(&t)?;
    let mut out = String::new();
    eval(&nodes, v, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_aligns_keys_on_the_longest() {
        let s = kv(&[("ID", "a".into()), ("Plugin ID", "bind".into())]);
        assert_eq!(s, "ID        = a\nPlugin ID = bind\n");
    }

    #[test]
    fn table_pads_columns_and_prints_the_empty_message_without_rows() {
        let s = table(
            &["ID", "Name"],
            &[
                vec!["1".into(), "data".into()],
                vec!["22".into(), "x".into()],
            ],
            "No volumes",
        );
        assert_eq!(s, "ID  Name\n1   data\n22  x\n");
        assert_eq!(table(&["ID"], &[], "No volumes"), "No volumes\n");
    }

    #[test]
    fn capacity_and_ages_are_human_readable() {
        assert_eq!(bytes(1 << 30), "1.0 GiB");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(ago(100, 112), "12s ago");
        assert_eq!(ago(100, 100 + 184), "3m4s ago");
        assert_eq!(ago(0, 5), "never");
    }

    #[test]
    fn template_prints_fields_and_ranges() {
        let v = serde_json::json!({"node": "n1", "plugins": [{"id": "bind"}, {"id": "nfs"}]});
        assert_eq!(
            template("{{.node}}:{{range .plugins}} {{.id}}{{end}}\\n", &v).unwrap(),
            "n1: bind nfs\n"
        );
        assert_eq!(template("{{.nope}}", &v).unwrap(), "<no value>");
        assert_eq!(
            template("{{range .plugins}}", &v),
            Err(TemplateError::UnendedRange)
        );
        assert!(matches!(
            template("{{len .plugins}}", &v),
            Err(TemplateError::Unsupported(_))
        ));
    }

    #[test]
    fn json_and_template_flags_choose_the_form() {
        let v = serde_json::json!({"a": 1});
        let human = |_: &serde_json::Value| "readable\n".to_string();
        let o = OutputArgs::default();
        assert_eq!(o.render(&v, human).unwrap(), "readable\n");
        let o = OutputArgs {
            json: true,
            ..Default::default()
        };
        assert_eq!(o.render(&v, human).unwrap(), "{\n  \"a\": 1\n}\n");
        let o = OutputArgs {
            template: Some("{{.a}}".into()),
            ..Default::default()
        };
        assert_eq!(o.render(&v, human).unwrap(), "1");
    }
}
