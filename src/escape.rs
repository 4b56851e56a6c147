//! Terminal-safe text: what a plugin, a caller or Nomad wrote, made safe to print or log.

/// Escapes control characters (C0, DEL, C1, and the Unicode bidirectional overrides that
/// reorder what a terminal shows) as `\u{..}`, and backslashes as `\\`, so text from a plugin or a
/// server cannot move a terminal's cursor, fake log lines or hide what follows.
pub fn escape_control(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}');
        if c == '\\' {
            out.push_str("\\\\");
        } else if c.is_control() || bidi {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_overrides_are_escaped() {
        assert_eq!(escape_control("plain ünïcode"), "plain ünïcode");
        assert_eq!(
            escape_control("a\u{1b}[2Jb\r\n\u{202e}c\\\u{7f}\u{85}"),
            "a\\u{1b}[2Jb\\u{d}\\u{a}\\u{202e}c\\\\\\u{7f}\\u{85}"
        );
    }
}
