//! Secrets taken out of text that leaves the agent: a plugin's words (its error, stderr,
//! stdout) before they reach a log, a record or a caller, in every form a plugin commonly
//! prints a secret (as is, escaped, URL-encoded, base64 and hex, alone or in a `user:value`
//! pair such as an HTTP Basic header).

use crate::escape::escape_control;
use std::collections::BTreeMap;

/// Shortest line of a multi-line secret redacted on its own (shorter lines, such as a lone
/// `}`, would redact too much ordinary text).
const MIN_SECRET_LINE: usize = 4;

/// The forms in which a secret may appear in text: as is, JSON-escaped, Rust-`Debug`-escaped,
/// control-escaped ([`escape_control`]), `\u`- and URL-encoded, base64 and hex encoded
/// ([`encoded_forms`]), and each line of a multi-line secret. Longest first.
fn secret_forms(secrets: &BTreeMap<String, String>) -> Vec<String> {
    let mut forms: Vec<String> = Vec::new();
    let values: Vec<&str> = secrets
        .values()
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .collect();
    for v in secrets.values().filter(|v| !v.is_empty()) {
        forms.extend(encoded_forms(v, &values));
        let json = serde_json::to_string(v).unwrap_or_default();
        let debug = format!("{v:?}");
        forms.push(v.clone());
        forms.push(
            json.get(1..json.len().saturating_sub(1))
                .unwrap_or_default()
                .to_string(),
        );
        forms.push(
            debug
                .get(1..debug.len().saturating_sub(1))
                .unwrap_or_default()
                .to_string(),
        );
        forms.push(escape_control(v));
        forms.extend(unicode_escaped_forms(v));
        forms.extend(url_encoded_forms(v));
        if v.contains(['\n', '\r']) {
            forms.extend(
                v.split(['\n', '\r'])
                    .map(str::trim)
                    .filter(|l| l.chars().count() >= MIN_SECRET_LINE)
                    .map(str::to_string),
            );
        }
    }
    forms.retain(|f| !f.is_empty());
    forms.sort_by_key(|f| std::cmp::Reverse(f.len()));
    forms.dedup();
    forms
}

/// `c` as `\uXXXX` (two for a character beyond the BMP, as JSON writes it), in lower or
/// upper hex.
fn u_escape(c: char, upper: bool, out: &mut String) {
    use std::fmt::Write as _;
    let mut units = [0u16; 2];
    for u in c.encode_utf16(&mut units) {
        let _ = if upper {
            write!(out, "\\u{u:04X}")
        } else {
            write!(out, "\\u{u:04x}")
        };
    }
}

/// A secret in the `\uXXXX` forms JSON encoders write (issue 33): every character escaped
/// (lower and upper hex), and the JSON form with only non-ASCII (Python's `ensure_ascii`),
/// only `<`, `>`, `&` (Go's `encoding/json`), or both escaped.
fn unicode_escaped_forms(v: &str) -> Vec<String> {
    let mut forms = Vec::new();
    for upper in [false, true] {
        let mut all = String::new();
        for c in v.chars() {
            u_escape(c, upper, &mut all);
        }
        forms.push(all);
    }
    let json = serde_json::to_string(v).unwrap_or_default();
    let inner = json
        .get(1..json.len().saturating_sub(1))
        .unwrap_or_default();
    let html = |c: char| matches!(c, '<' | '>' | '&');
    let rules: [&dyn Fn(char) -> bool; 3] = [&|c: char| !c.is_ascii(), &html, &|c: char| {
        !c.is_ascii() || html(c)
    }];
    for escape in rules {
        let mut f = String::new();
        for c in inner.chars() {
            if escape(c) {
                u_escape(c, false, &mut f);
            } else {
                f.push(c);
            }
        }
        forms.push(f);
    }
    forms
}

/// A secret URL-encoded (issue 33): percent-encoding all but RFC 3986's unreserved
/// characters, all but those `encodeURIComponent` keeps, and form encoding (space as `+`);
/// upper and lower hex.
fn url_encoded_forms(v: &str) -> Vec<String> {
    use std::fmt::Write as _;
    let unreserved = |c: u8| c.is_ascii_alphanumeric() || b"-._~".contains(&c);
    let component = |c: u8| c.is_ascii_alphanumeric() || b"-_.!~*'()".contains(&c);
    let form = |c: u8| c.is_ascii_alphanumeric() || b"*-._".contains(&c);
    let keeps: [&dyn Fn(u8) -> bool; 3] = [&unreserved, &component, &form];
    let mut forms = Vec::new();
    for (i, keep) in keeps.into_iter().enumerate() {
        for upper in [true, false] {
            let mut f = String::new();
            for &b in v.as_bytes() {
                if keep(b) {
                    f.push(char::from(b));
                } else if b == b' ' && i == 2 {
                    f.push('+');
                } else if upper {
                    let _ = write!(f, "%{b:02X}");
                } else {
                    let _ = write!(f, "%{b:02x}");
                }
            }
            forms.push(f);
        }
    }
    forms
}

/// The shortest base64 run redacted where a secret sits at an unknown place in what was
/// encoded ([`encoded_forms`]): two groups of four characters, six bytes of the secret.
/// Shorter runs would match ordinary words.
const MIN_BASE64_CORE: usize = 8;

/// `bytes` in each base64 alphabet plugins print: standard and URL-safe, with and without
/// padding.
fn base64_forms(bytes: &[u8]) -> [String; 4] {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    use base64::Engine as _;
    [
        STANDARD.encode(bytes),
        STANDARD_NO_PAD.encode(bytes),
        URL_SAFE.encode(bytes),
        URL_SAFE_NO_PAD.encode(bytes),
    ]
}

/// A secret `v` as a plugin may print it encoded (issue 44): base64 (standard and URL-safe,
/// padded or not) and hex (lower and upper case) of the value, and of the `user:value`
/// pairs an HTTP Basic header carries, with `user` each other secret value (a username kept
/// among the secrets) or empty. Wherever else the value sits in what was base64-encoded
/// (`admin:<value>`, a token inside JSON), the characters that only its bytes decide, for
/// each of the three alignments, when they are at least [`MIN_BASE64_CORE`] long (a few
/// characters at each end, which also depend on the bytes around it, stay). Hex of the
/// value anywhere is its own hex.
fn encoded_forms(v: &str, values: &[&str]) -> Vec<String> {
    let mut forms = Vec::new();
    let hex = |b: &[u8]| {
        let lower: String = b.iter().map(|x| format!("{x:02x}")).collect();
        [lower.to_ascii_uppercase(), lower]
    };
    let mut wholes: Vec<Vec<u8>> = vec![v.as_bytes().to_vec(), format!(":{v}").into_bytes()];
    for user in values.iter().filter(|u| **u != v) {
        wholes.push(format!("{user}:{v}").into_bytes());
    }
    for w in &wholes {
        forms.extend(base64_forms(w));
        forms.extend(hex(w));
    }
    for offset in 0..3usize {
        let mut buf = vec![0u8; offset];
        buf.extend_from_slice(v.as_bytes());
        // Groups of three bytes that hold only the secret's: from the first whole group
        // after the filler to the last whole one.
        let (first, end) = (offset.div_ceil(3), buf.len() / 3);
        if end <= first || (end - first) * 4 < MIN_BASE64_CORE {
            continue;
        }
        let [std, _, url, _] = base64_forms(&buf);
        for enc in [std, url] {
            if let Some(core) = enc.get(first * 4..end * 4) {
                forms.push(core.to_string());
            }
        }
    }
    forms
}

/// Replaces every secret value in `text` with `[redacted]`, in each form it may have been
/// escaped to (`secret_forms`). Call it on raw text, before escaping or truncating.
pub fn redact(text: &str, secrets: &BTreeMap<String, String>) -> String {
    let mut out = text.to_string();
    for f in secret_forms(secrets) {
        if out.contains(f.as_str()) {
            out = out.replace(f.as_str(), "[redacted]");
        }
    }
    out
}

/// Plugin text made safe for a log: redacted first, then control-escaped, then cut to its
/// last `limit` bytes (on a character boundary).
pub fn sanitize_tail(raw: &[u8], secrets: &BTreeMap<String, String>, limit: usize) -> String {
    let text = escape_control(&redact(&String::from_utf8_lossy(raw), secrets));
    let mut start = text.len().saturating_sub(limit);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text.get(start..).unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33: secrets in `\uXXXX`-escaped form (every character, or only non-ASCII and
    /// `<>&` as Python's and Go's JSON encoders write them) and URL-encoded (RFC 3986,
    /// form encoding with `+`, lowercase hex) are redacted too.
    #[test]
    fn unicode_escaped_and_url_encoded_secrets_are_redacted() {
        let secrets = BTreeMap::from([
            ("a".to_string(), "p@ss wörd&<x>".to_string()),
            ("b".to_string(), "k😀ey!".to_string()),
        ]);
        let forms = [
            r"\u0070\u0040\u0073\u0073\u0020\u0077\u00f6\u0072\u0064\u0026\u003c\u0078\u003e",
            r"\u0070\u0040\u0073\u0073\u0020\u0077\u00F6\u0072\u0064\u0026\u003C\u0078\u003E",
            r"p@ss w\u00f6rd&<x>",
            r"p@ss wörd\u0026\u003cx\u003e",
            r"p@ss w\u00f6rd\u0026\u003cx\u003e",
            "p%40ss%20w%C3%B6rd%26%3Cx%3E",
            "p%40ss+w%C3%B6rd%26%3Cx%3E",
            "p%40ss%20w%c3%b6rd%26%3cx%3e",
            r"\u006b\ud83d\ude00\u0065\u0079\u0021",
            r"k\ud83d\ude00ey!",
            "k%F0%9F%98%80ey%21",
            "k%F0%9F%98%80ey!",
        ];
        for f in forms {
            let text = format!("before {f} after");
            assert_eq!(
                redact(&text, &secrets),
                "before [redacted] after",
                "form {f:?} leaked"
            );
        }
        // Text that only looks alike stays.
        assert_eq!(redact("p%40ss", &secrets), "p%40ss");
    }

    /// Issue 44 #6: a secret a plugin prints base64- or hex-encoded (alone, as an HTTP Basic
    /// header's `user:value` with the user among the secrets or not, inside a longer encoded
    /// text) is redacted too.
    #[test]
    fn base64_and_hex_encoded_secrets_are_redacted() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        use base64::Engine as _;
        let secrets = BTreeMap::from([
            ("user".to_string(), "backup-svc".to_string()),
            ("password".to_string(), "s3cr3t?>>pa55".to_string()),
        ]);
        let pass = "s3cr3t?>>pa55";
        let hex: String = pass.bytes().map(|b| format!("{b:02x}")).collect();
        let whole = [
            STANDARD.encode(pass),
            URL_SAFE_NO_PAD.encode(pass),
            STANDARD.encode(format!("backup-svc:{pass}")),
            URL_SAFE_NO_PAD.encode(format!("backup-svc:{pass}")),
            STANDARD.encode(format!(":{pass}")),
            hex.clone(),
            hex.to_ascii_uppercase(),
        ];
        for f in &whole {
            let text = format!("Authorization: Basic {f} refused");
            assert_eq!(
                redact(&text, &secrets),
                "Authorization: Basic [redacted] refused",
                "form {f:?} leaked"
            );
        }
        // A user that is no secret, and the secret inside a longer encoded text, at each
        // alignment: what is left cannot give the secret back.
        for prefix in ["admin:", "ab:", "a:", "{\"token\":\""] {
            for enc in [
                STANDARD.encode(format!("{prefix}{pass}\"}}")),
                URL_SAFE_NO_PAD.encode(format!("{prefix}{pass}")),
            ] {
                let out = redact(&format!("header {enc} end"), &secrets);
                assert!(out.contains("[redacted]"), "{prefix:?}: {out}");
                let left = out.replace("[redacted]", "");
                assert!(!left.contains(&enc), "{out}");
                for piece in left.split(['[', ']', ' ']) {
                    for d in [STANDARD.decode(piece), URL_SAFE_NO_PAD.decode(piece)]
                        .into_iter()
                        .flatten()
                    {
                        assert!(!String::from_utf8_lossy(&d).contains("cr3t"), "{out}");
                    }
                }
            }
        }
        // Hex of the value inside a longer hex dump.
        assert_eq!(
            redact(&format!("dump 4142{hex}0a end"), &secrets),
            "dump 4142[redacted]0a end"
        );
        // Ordinary text stays.
        assert_eq!(redact("all good: 200 OK", &secrets), "all good: 200 OK");
    }
}
