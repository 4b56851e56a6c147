//! How read commands print: a readable Nomad-style form (aligned `Key = value` blocks and
//! column tables, as `nomad volume status` prints them), `-json` for machines, and `-t` with
//! a Go template over the same JSON. The JSON is the commands' output structs, whose fields
//! are named as Nomad's API names them (`ID`, `Name`, `PluginID`, `CapacityBytes`), each
//! struct by `#[serde(rename_all = "PascalCase")]` and explicit renames for the `ID`
//! acronyms; dhv-binder's own times are RFC 3339 strings ([`rfc3339`]). The agent's status
//! document, which the agent builds as snake_case JSON for its local API, is converted by
//! one rule instead ([`nomad_json`]), so fields added to it follow without a mirror struct.

use super::{Failure, EXIT_CONFIG};
use crate::escape::escape_control;
use serde::Serialize;

/// The output flags every read command takes.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OutputArgs {
    /// Print the full answer as JSON instead of the readable summary (`-json` works too).
    #[arg(long = "json", conflicts_with = "template")]
    pub json: bool,
    /// Format the JSON answer with a Go template, as Nomad's `-t`: fields by their JSON
    /// name, which is Nomad's (`{{.ID}}`, `{{.Name}}`, `{{.PluginID}}`); `range`, `if`,
    /// `printf`, pipes.
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
            // A template's output ends with a newline, as Nomad's `-t` (its UI's `Output`).
            let mut s = template(t, &v).map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
            if !s.is_empty() && !s.ends_with('\n') {
                s.push('\n');
            }
            return Ok(s);
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

/// A byte count in binary units with IEC symbols, one decimal: `1073741824` is `1.0 GiB`,
/// `421888` is `412.0 KiB` (capital K: bytesize 1.x prints `kiB`), below 1 KiB `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    // Compared as printed (one decimal), so 1048575 is `1.0 MiB`, not `1024.0 KiB`.
    while (value * 10.0).round() >= 10240.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `n` and the noun, singular for 1: `plural(1, "reconnect", "reconnects")` is
/// `1 reconnect`, `plural(3, ..)` is `3 reconnects`.
pub fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
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

/// A template that cannot be parsed or rendered (from Go's template language, as
/// implemented by the `gtmpl` crate).
#[derive(Debug, thiserror::Error)]
#[error("template: {0}")]
pub struct TemplateError(String);

/// Unix seconds as an RFC 3339 time in UTC, to the second (`2026-12-04T22:10:00Z`): how
/// `-json` prints dhv-binder's own times; `None` for 0 (unknown).
pub fn rfc3339(unix_secs: u64) -> Option<String> {
    if unix_secs == 0 {
        return None;
    }
    let t = std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(unix_secs))?;
    Some(humantime::format_rfc3339_seconds(t).to_string())
}

/// Serializes a Unix-seconds field as [`rfc3339`]: a string, or `null` when 0 (unknown).
/// For `#[serde(serialize_with = "...")]` on the output structs of `-json`.
pub fn ser_rfc3339<S: serde::Serializer>(unix_secs: &u64, s: S) -> Result<S::Ok, S::Error> {
    match rfc3339(*unix_secs) {
        Some(t) => s.serialize_str(&t),
        None => s.serialize_none(),
    }
}

/// Where a snake_case document's objects are not structs, for [`nomad_json`]. Paths are
/// the document's own field names joined with `.`, from the top; arrays are transparent
/// (`mounts.publish_context` is the field of every element of `mounts`) and a map's keys
/// are written `*` (`holders.*.holders`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape<'a> {
    /// Objects whose keys are data (plugin IDs, `namespace/name`, allocation IDs), not field
    /// names: their keys stay as they are, their values are converted. Keys that are no
    /// snake_case word (`default/data`, a UUID) are never converted, so only maps keyed by
    /// words (plugin IDs) must be listed.
    pub maps: &'a [&'a str],
    /// Values copied as they are, keys and all: JSON a plugin returned (its `context`).
    pub opaque: &'a [&'a str],
}

/// Go's initialisms as Nomad's API spells them (`NodeID`, `AllocIDs`, `FSType`,
/// `CPUShares`): the words of a snake_case name that [`pascal_case`] writes in capitals.
pub const INITIALISMS: &[(&str, &str)] = &[
    ("acl", "ACL"),
    ("api", "API"),
    ("cpu", "CPU"),
    ("fs", "FS"),
    ("http", "HTTP"),
    ("id", "ID"),
    ("ids", "IDs"),
    ("ip", "IP"),
    ("json", "JSON"),
    ("rss", "RSS"),
    ("tls", "TLS"),
    ("ttl", "TTL"),
    ("uid", "UID"),
    ("url", "URL"),
    ("urls", "URLs"),
    ("uuid", "UUID"),
];

/// True for a snake_case field name: lowercase words of letters and digits joined by
/// single underscores, starting with a letter (`node_id`, `list_bytes`, `p95`).
fn is_snake_field(key: &str) -> bool {
    key.starts_with(|c: char| c.is_ascii_lowercase())
        && key.split('_').all(|w| {
            !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        })
}

/// A snake_case field name in Nomad's casing: each word capitalised, Go's initialisms in
/// capitals ([`INITIALISMS`]): `node_id` is `NodeID`, `publish_latency_ms` is
/// `PublishLatencyMs`, `fs_type` is `FSType`. Anything else (`default/data`, a UUID, an
/// already PascalCase name) is returned as it is.
pub fn pascal_case(key: &str) -> String {
    if !is_snake_field(key) {
        return key.to_string();
    }
    key.split('_')
        .map(|w| match INITIALISMS.iter().find(|(s, _)| *s == w) {
            Some((_, caps)) => (*caps).to_string(),
            None => {
                let mut c = w.chars();
                c.next()
                    .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                    .unwrap_or_default()
            }
        })
        .collect()
}

/// True for a field the agent's documents hold Unix seconds in: `since`, `*_since` and
/// `time` (a volume's changes of condition).
fn is_time_field(key: &str) -> bool {
    key == "since" || key == "time" || key.ends_with("_since")
}

/// A snake_case JSON document (the agent's `GET /v1/status`) in Nomad's casing, as `-json`
/// prints dhv-binder's own structs: every field name through [`pascal_case`], except the
/// keys of `shape.maps` and everything under `shape.opaque`; the Unix seconds of fields
/// named `since`, `*_since` or `time` as [`rfc3339`] strings (`null` for 0). Values (states,
/// reasons, IDs) are unchanged. The rule is applied to whatever the document holds, so a
/// field added to it is converted without being listed anywhere; only a new map keyed by
/// words (like plugin IDs) or a new plugin-returned object needs a line in its `Shape`.
pub fn nomad_json(v: &serde_json::Value, shape: &Shape) -> serde_json::Value {
    convert(v, "", shape)
}

fn convert(v: &serde_json::Value, path: &str, shape: &Shape) -> serde_json::Value {
    use serde_json::Value;
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Array(a) => Value::Array(a.iter().map(|e| convert(e, path, shape)).collect()),
        Value::Object(m) if shape.maps.contains(&path) => {
            let p = join("*");
            Value::Object(
                m.iter()
                    .map(|(k, e)| (k.clone(), convert(e, &p, shape)))
                    .collect(),
            )
        }
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, e)| {
                    let p = join(if is_snake_field(k) { k } else { "*" });
                    let e = if shape.opaque.contains(&p.as_str()) {
                        e.clone()
                    } else if let (true, Some(secs)) = (is_time_field(k), e.as_u64()) {
                        rfc3339(secs).map_or(Value::Null, Value::String)
                    } else {
                        convert(e, &p, shape)
                    };
                    (pascal_case(k), e)
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The template's data: the command's JSON as it is (the output structs name their fields
/// as Nomad's API does, so `{{.ID}}`, `{{.Name}}` and `{{.PluginID}}` work as they do with
/// `nomad ... -t`). Objects behave as Go structs: a field that does not exist is an error,
/// not an empty string. Every string and key is terminal-escaped ([`escape_control`]), as
/// the readable output is: record fields come from records, plugins and Nomad, and a
/// template prints them to a terminal; the template's own text (its `\n`, `{{"\t"}}`) is
/// not data and stays as written.
fn to_gtmpl(v: &serde_json::Value) -> gtmpl::Value {
    use gtmpl::Value as G;
    match v {
        serde_json::Value::Null => G::Nil,
        serde_json::Value::Bool(b) => G::Bool(*b),
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => G::from(u),
            (None, Some(i)) => G::from(i),
            _ => G::from(n.as_f64().unwrap_or(0.0)),
        },
        serde_json::Value::String(s) => G::String(escape_control(s)),
        serde_json::Value::Array(a) => G::Array(a.iter().map(to_gtmpl).collect()),
        serde_json::Value::Object(m) => G::Object(
            m.iter()
                .map(|(k, v)| (escape_control(k), to_gtmpl(v)))
                .collect(),
        ),
    }
}

/// Renders a Go template over a JSON value (the `-json` form of the same command): fields
/// (`{{.Name}}`), `if`/`else`, `range`, `with`, variables, pipes and the standard functions
/// (`printf`, `len`, `index`, `eq`, `and`, `or`, `not`...). The escapes `\n` and `\t` typed in a
/// shell argument are honoured in the template's text; inside an action (`{{printf "%s\n"
/// .ID}}`) they are the template language's own string escapes, as in Nomad's `-t`.
pub fn template(t: &str, v: &serde_json::Value) -> Result<String, TemplateError> {
    let t = text_escapes(t);
    let mut tmpl = gtmpl::Template::default();
    tmpl.parse(t).map_err(|e| TemplateError(e.to_string()))?;
    tmpl.render(&gtmpl::Context::from(to_gtmpl(v)))
        .map_err(|e| TemplateError(readable_template_error(&e.to_string(), v)))
}

/// The template engine's error, without the internal dump of the value it names: "no field
/// X for {…}" becomes which fields there are (those of the top-level object, or of the
/// first element of a list).
fn readable_template_error(message: &str, v: &serde_json::Value) -> String {
    let Some((field, _)) = message
        .strip_prefix("no field ")
        .and_then(|m| m.split_once(" for "))
    else {
        return message.to_string();
    };
    let object = match v {
        serde_json::Value::Array(a) => a.first(),
        other => Some(other),
    };
    let fields: Vec<&str> = object
        .and_then(|o| o.as_object())
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    format!(
        "no field {field:?} in the template's data; its fields are: {} (`-json` prints the data)",
        fields.join(", ")
    )
}

/// `\n` and `\t` outside the template's actions (`{{ ... }}`) made a newline and a tab; the
/// actions are left as written, so their quoted strings keep their escapes for the template
/// language to read.
fn text_escapes(t: &str) -> String {
    let mut out = String::with_capacity(t.len());
    let mut rest = t;
    while !rest.is_empty() {
        let (text, action) = match rest.find("{{") {
            Some(i) => {
                let end = rest[i..].find("}}").map_or(rest.len(), |j| i + j + 2);
                (&rest[..i], &rest[i..end])
            }
            None => (rest, ""),
        };
        out.push_str(&text.replace("\\n", "\n").replace("\\t", "\t"));
        out.push_str(action);
        rest = &rest[text.len() + action.len()..];
    }
    out
}

/// A plugin's failure as a record keeps it (the agent's one-line report: `… failed (exit
/// code 1): error: X; stderr: Y`, the plugin's line breaks escaped as `\u{a}`), made one
/// readable line: the escaped line breaks become `; `, and stderr that only repeats the
/// plugin's error is left out. Not terminal-safe by itself: printed through [`kv`],
/// [`table`] or `escape_control` as every record's text is.
pub fn plugin_text(s: &str) -> String {
    let s = s.replace("\\u{d}", "").replace("\\u{a}", "\n");
    let (head, stderr) = match s.split_once("; stderr: ") {
        Some((h, e)) => (h.to_string(), Some(e.to_string())),
        None => (s.clone(), None),
    };
    let lines = |t: &str| -> Vec<String> {
        t.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    };
    let mut out = lines(&head).join("; ");
    if let Some(e) = stderr {
        let error = head
            .rsplit_once("error: ")
            .map(|(_, m)| m.trim())
            .unwrap_or("");
        let e: Vec<String> = lines(&e)
            .into_iter()
            .filter(|l| error.is_empty() || !error.contains(l.as_str()))
            .collect();
        if !e.is_empty() {
            out.push_str("; stderr: ");
            out.push_str(&e.join("; "));
        }
    }
    out
}

/// A measured duration as the CLI prints it: `132ms` below a second, else `1.2s`.
pub fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else {
        format!("{:.1}s", ms as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_in_an_actions_string_are_the_template_languages_own() {
        let v = serde_json::json!({"ID": "abc", "Tags": ["x", "y"]});
        assert_eq!(template(r#"{{printf "%s\n" .ID}}"#, &v).unwrap(), "abc\n");
        assert_eq!(
            template(r#"{{.ID}}{{"\t"}}{{.ID}}"#, &v).unwrap(),
            "abc\tabc"
        );
        assert_eq!(
            template(r#"{{range .Tags}}{{.}}\n{{end}}"#, &v).unwrap(),
            "x\ny\n"
        );
    }

    /// Issue 46: a plugin's failure is one line without `\u{a}` escapes, and stderr that
    /// repeats the plugin's error is not printed twice.
    #[test]
    fn a_plugin_failure_is_one_line_said_once() {
        let rec = r#"plugin "bind" create failed (exit code 1): error: export /srv is not a directory; stderr: export /srv is not a directory\u{a}"#;
        assert_eq!(
            plugin_text(rec),
            r#"plugin "bind" create failed (exit code 1): error: export /srv is not a directory"#
        );
        let rec = r#"plugin "x" create failed (exit code 1): error: no room; stderr: mkfs: 1\u{a}mkfs: 2\u{a}"#;
        assert_eq!(
            plugin_text(rec),
            r#"plugin "x" create failed (exit code 1): error: no room; stderr: mkfs: 1; mkfs: 2"#
        );
        assert_eq!(plugin_text("plain"), "plain");
    }

    /// Issue 46: an unknown field names the fields there are, not a Rust `Debug` dump; a
    /// template's output ends with a newline.
    #[test]
    fn an_unknown_field_names_the_fields_and_output_ends_with_a_newline() {
        let v = serde_json::json!([{"ID": "abc", "Name": "x"}]);
        let e = template("{{range .}}{{.Nope}}{{end}}", &v)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no field \"Nope\"") && e.contains("ID, Name") && !e.contains("String("),
            "{e}"
        );
        let out = OutputArgs {
            template: Some("{{range .}}{{.ID}}{{end}}".into()),
            ..Default::default()
        };
        assert_eq!(out.render(&v, |_| unreachable!()).unwrap(), "abc\n");
    }

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
        assert_eq!(bytes(421_888), "412.0 KiB");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes((1 << 20) - 1), "1.0 MiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
        assert_eq!(plural(1, "volume", "volumes"), "1 volume");
        assert_eq!(plural(0, "volume", "volumes"), "0 volumes");
        assert_eq!(ago(100, 112), "12s ago");
        assert_eq!(ago(100, 100 + 184), "3m4s ago");
        assert_eq!(ago(0, 5), "never");
    }

    /// Issue 44 #8: fields printed through `-t` are escaped as in the readable output (a
    /// record's escape sequences never reach the terminal); the template's own newlines and
    /// tabs are kept.
    #[test]
    fn template_output_escapes_control_characters_of_the_data() {
        let v = serde_json::json!({
            "Error": "disk \u{1b}[2Jgone\r\nfake: ok\u{202e}",
            "Context": {"k\u{7}ey": "v\u{1b}]0;title\u{7}"},
        });
        assert_eq!(
            template("{{.Error}}\\n", &v).unwrap(),
            "disk \\u{1b}[2Jgone\\u{d}\\u{a}fake: ok\\u{202e}\n"
        );
        assert_eq!(
            template(
                "{{range $k, $v := .Context}}{{$k}}={{$v}}{{\"\\t\"}}{{end}}",
                &v
            )
            .unwrap(),
            "k\\u{7}ey=v\\u{1b}]0;title\\u{7}\t"
        );
        let out = template("{{.Error}}{{printf \"%s\" .Error}}", &v).unwrap();
        assert!(!out.chars().any(|c| c.is_control()), "{out:?}");
    }

    #[test]
    fn template_prints_fields_and_ranges() {
        let v = serde_json::json!({"node": "n1", "plugins": [{"id": "bind"}, {"id": "nfs"}]});
        assert_eq!(
            template("{{.node}}:{{range .plugins}} {{.id}}{{end}}\\n", &v).unwrap(),
            "n1: bind nfs\n"
        );
        // A field that does not exist is an error naming it, as with Go structs.
        let e = template("{{.nope}}", &v).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        assert!(template("{{range .plugins}}", &v).is_err());
    }

    /// Issue 37 #6: Go template basics (if, range, printf, pipes, len) over Nomad's keys,
    /// which the JSON itself carries: a snake_case key is not also offered under Nomad's name.
    #[test]
    fn templates_take_go_template_basics_over_the_json_as_it_is() {
        let v = serde_json::json!([
            {"ID": "0b9c6a6e-1111", "Name": "a", "PluginID": "bind", "CapacityBytes": 1024, "Registered": false},
            {"ID": "7f00aa00-2222", "Name": "b", "PluginID": "nfs", "CapacityBytes": 0, "Registered": true}
        ]);
        let t = "{{range .}}{{.ID}} {{.Name}} {{.PluginID}}{{if .Registered}} (registered){{end}}\\n{{end}}";
        assert_eq!(
            template(t, &v).unwrap(),
            "0b9c6a6e-1111 a bind\n7f00aa00-2222 b nfs (registered)\n"
        );
        assert_eq!(
            template("{{len .}} {{printf \"%s=%d\" (index . 0).Name (index . 0).CapacityBytes}} {{(index . 1).Name | printf \"<%s>\"}}", &v)
                .unwrap(),
            "2 a=1024 <b>"
        );
        let snake = serde_json::json!({"plugin_id": "bind"});
        assert!(template("{{.PluginID}}", &snake).is_err());
    }

    #[test]
    fn times_are_rfc3339_in_utc_and_unknown_is_null() {
        assert_eq!(rfc3339(0), None);
        assert_eq!(
            rfc3339(1_733_350_200).as_deref(),
            Some("2024-12-04T22:10:00Z")
        );
        #[derive(Serialize)]
        struct T {
            #[serde(serialize_with = "ser_rfc3339")]
            at: u64,
        }
        assert_eq!(
            serde_json::to_value(T { at: 1_733_350_200 }).unwrap(),
            serde_json::json!({"at": "2024-12-04T22:10:00Z"})
        );
        assert_eq!(
            serde_json::to_value(T { at: 0 }).unwrap(),
            serde_json::json!({"at": null})
        );
    }

    #[test]
    fn snake_case_names_take_nomads_casing_and_initialisms() {
        for (snake, nomad) in [
            ("node_id", "NodeID"),
            ("alloc_ids", "AllocIDs"),
            ("placeholder_id", "PlaceholderID"),
            ("publish_latency_ms", "PublishLatencyMs"),
            ("fs_type", "FSType"),
            ("check_url", "CheckURL"),
            ("cpu_rss", "CPURSS"),
            ("p95", "P95"),
            ("since", "Since"),
        ] {
            assert_eq!(pascal_case(snake), nomad);
        }
        // Data is no field name: it stays as it is.
        for data in [
            "default/data",
            "0b9c6a6e-1111",
            "NodeID",
            "a__b",
            "_x",
            "x_",
            "Bind",
        ] {
            assert_eq!(pascal_case(data), data);
        }
    }

    #[test]
    fn nomad_json_converts_fields_times_and_arrays_but_not_data() {
        let v = serde_json::json!({
            "node_id": "n",
            "plugins": {"bind": {"deferred_bind": true}},
            "errors": {"default/a": "boom"},
            "unlisted": {"default/a": {"alloc_id": "x"}},
            "mounts": [{"since": 1_733_350_200, "publish_context": {"dev_path": "/dev/x"}, "volume": {"name": "a"}}],
            "journal": {"failing_since": 0, "state": "some_value"}
        });
        let shape = Shape {
            maps: &["plugins", "errors"],
            opaque: &["mounts.publish_context"],
        };
        assert_eq!(
            nomad_json(&v, &shape),
            serde_json::json!({
                "NodeID": "n",
                "Plugins": {"bind": {"DeferredBind": true}},
                "Errors": {"default/a": "boom"},
                "Unlisted": {"default/a": {"AllocID": "x"}},
                "Mounts": [{"Since": "2024-12-04T22:10:00Z", "PublishContext": {"dev_path": "/dev/x"}, "Volume": {"Name": "a"}}],
                "Journal": {"FailingSince": null, "State": "some_value"}
            })
        );
        // Without the map listed, its word keys would be taken for fields.
        let v = serde_json::json!({"plugins": {"bind": {}}});
        assert_eq!(
            nomad_json(&v, &Shape::default()),
            serde_json::json!({"Plugins": {"Bind": {}}})
        );
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
        assert_eq!(o.render(&v, human).unwrap(), "1\n");
    }
}
