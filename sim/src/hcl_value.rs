//! Conversion of HCL expressions to JSON values, keeping `${...}` templates as literal strings.
//!
//! Nomad's jobspec parser leaves runtime interpolations such as `${NOMAD_ALLOC_DIR}` or
//! `${node.unique.id}` untouched for the client to resolve; we do the same by turning template
//! expressions back into their source text.

use hcl::{Block, BlockLabel, Body, Expression, ObjectKey, TemplateExpr};
use serde_json::{Map, Value};

/// Errors converting HCL.
#[derive(Debug, thiserror::Error)]
pub enum HclError {
    /// Syntax error from hcl-rs.
    #[error("parse error: {0}")]
    Parse(#[from] hcl::Error),
    /// An expression kind we do not evaluate (functions, variables, operators).
    #[error("unsupported expression in {0}: {1}")]
    Unsupported(String, String),
    /// Wrong value type for a known key.
    #[error("{0}: {1}")]
    Invalid(String, String),
}

fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('r') => out.push('\r'),
                Some('"') => out.push('"'),
                Some('\\') => out.push('\\'),
                Some(o) => {
                    out.push('\\');
                    out.push(o)
                }
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    // `$${` escapes a literal `${` in HCL templates.
    out.replace("$${", "${")
}

/// Converts an expression to JSON. `ctx` names the attribute for error messages.
pub fn expr_to_json(ctx: &str, expr: &Expression) -> Result<Value, HclError> {
    Ok(match expr {
        Expression::Null => Value::Null,
        Expression::Bool(b) => Value::Bool(*b),
        Expression::Number(n) => serde_json::to_value(n).unwrap_or(Value::Null),
        Expression::String(s) => Value::String(s.clone()),
        Expression::Array(a) => Value::Array(
            a.iter()
                .map(|e| expr_to_json(ctx, e))
                .collect::<Result<_, _>>()?,
        ),
        Expression::Object(o) => {
            let mut m = Map::new();
            for (k, v) in o.iter() {
                let key = match k {
                    ObjectKey::Identifier(i) => i.to_string(),
                    ObjectKey::Expression(e) => match expr_to_json(ctx, e)? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    },
                    other => other.to_string(),
                };
                m.insert(key, expr_to_json(ctx, v)?);
            }
            Value::Object(m)
        }
        Expression::TemplateExpr(t) => match t.as_ref() {
            TemplateExpr::QuotedString(s) => Value::String(unescape(s)),
            TemplateExpr::Heredoc(h) => Value::String(h.template.clone()),
        },
        Expression::Parenthesis(e) => expr_to_json(ctx, e)?,
        other => return Err(HclError::Unsupported(ctx.into(), other.to_string())),
    })
}

/// Label `i` of a block as a string.
pub fn label(block: &Block, i: usize) -> Option<String> {
    block.labels.get(i).map(|l| match l {
        BlockLabel::Identifier(id) => id.to_string(),
        BlockLabel::String(s) => s.clone(),
    })
}

/// All attributes of a body as a JSON object (blocks ignored).
pub fn attributes(ctx: &str, body: &Body) -> Result<Map<String, Value>, HclError> {
    let mut m = Map::new();
    for a in body.attributes() {
        m.insert(
            a.key.to_string(),
            expr_to_json(&format!("{ctx}.{}", a.key), &a.expr)?,
        );
    }
    Ok(m)
}

/// Typed getters over an attribute map.
pub struct Attrs<'a> {
    /// Context for error messages, e.g. `job.group.task`.
    pub ctx: String,
    /// The attributes.
    pub map: &'a Map<String, Value>,
}

impl<'a> Attrs<'a> {
    /// Wraps a map.
    pub fn new(ctx: &str, map: &'a Map<String, Value>) -> Self {
        Attrs {
            ctx: ctx.into(),
            map,
        }
    }
    fn bad(&self, k: &str, what: &str) -> HclError {
        HclError::Invalid(format!("{}.{k}", self.ctx), format!("expected {what}"))
    }
    /// String attribute.
    pub fn str(&self, k: &str) -> Result<Option<String>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(Value::Bool(b)) => Ok(Some(b.to_string())),
            Some(_) => Err(self.bad(k, "string")),
        }
    }
    /// Boolean attribute.
    pub fn bool(&self, k: &str) -> Result<Option<bool>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s == "true" || s == "false" => Ok(Some(s == "true")),
            Some(_) => Err(self.bad(k, "bool")),
        }
    }
    /// Integer attribute.
    pub fn int(&self, k: &str) -> Result<Option<i64>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n.as_i64().map(Some).ok_or_else(|| self.bad(k, "integer")),
            Some(Value::String(s)) => s.parse().map(Some).map_err(|_| self.bad(k, "integer")),
            Some(_) => Err(self.bad(k, "integer")),
        }
    }
    /// Number attribute (an integer or a fraction).
    pub fn float(&self, k: &str) -> Result<Option<f64>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n.as_f64().map(Some).ok_or_else(|| self.bad(k, "number")),
            Some(Value::String(s)) => s.parse().map(Some).map_err(|_| self.bad(k, "number")),
            Some(_) => Err(self.bad(k, "number")),
        }
    }
    /// Duration attribute ("5s") in ns.
    pub fn duration_ns(&self, k: &str) -> Result<Option<i64>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_i64()),
            Some(Value::String(s)) => crate::clock::parse_go_duration(s)
                .map(|d| Some(d.as_nanos() as i64))
                .map_err(|_| self.bad(k, "duration")),
            Some(_) => Err(self.bad(k, "duration")),
        }
    }
    /// List of strings.
    pub fn strings(&self, k: &str) -> Result<Option<Vec<String>>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(self.bad(k, "list of strings")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(Value::String(s)) => Ok(Some(vec![s.clone()])),
            Some(_) => Err(self.bad(k, "list of strings")),
        }
    }
    /// Map of strings.
    pub fn string_map(
        &self,
        k: &str,
    ) -> Result<Option<std::collections::BTreeMap<String, String>>, HclError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => Ok(Some(
                o.iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            match v {
                                Value::String(s) => s.clone(),
                                other => other.to_string(),
                            },
                        )
                    })
                    .collect(),
            )),
            Some(_) => Err(self.bad(k, "map of strings")),
        }
    }
}

/// String map from an attribute or from a same-named block (`env { A = "b" }` or `env = {...}`).
pub fn map_attr_or_block(
    ctx: &str,
    body: &Body,
    name: &str,
) -> Result<Option<std::collections::BTreeMap<String, String>>, HclError> {
    let attrs = attributes(ctx, body)?;
    if let Some(m) = Attrs::new(ctx, &attrs).string_map(name)? {
        return Ok(Some(m));
    }
    let mut out = std::collections::BTreeMap::new();
    let mut found = false;
    for b in body.blocks().filter(|b| b.identifier.as_str() == name) {
        found = true;
        let inner = attributes(&format!("{ctx}.{name}"), &b.body)?;
        for (k, v) in inner {
            out.insert(
                k,
                match v {
                    Value::String(s) => s,
                    o => o.to_string(),
                },
            );
        }
    }
    Ok(found.then_some(out))
}
