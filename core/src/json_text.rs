//! Small text builders shared by the canonical form and the fingerprint payload,
//! written by hand so their exact bytes never depend on a serializer's choices.

/// Append `s` as a JSON string literal, escaped as RFC 8785 §3.2.2.2 requires:
/// only `"`, `\` and control characters are escaped; everything else is literal.
pub fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let v = u32::from(c) as usize;
                out.push_str("\\u00");
                out.push(char::from(HEX.get(v >> 4).copied().unwrap_or(b'0')));
                out.push(char::from(HEX.get(v & 0xf).copied().unwrap_or(b'0')));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Append one RFC 6901 reference token (`~` → `~0`, `/` → `~1`).
pub fn push_pointer_token(out: &mut String, token: &str) {
    for c in token.chars() {
        match c {
            '~' => out.push_str("~0"),
            '/' => out.push_str("~1"),
            c => out.push(c),
        }
    }
}

/// True if `p` is a syntactically valid RFC 6901 pointer (every `~` escapes).
pub fn is_json_pointer(p: &str) -> bool {
    if !(p.is_empty() || p.starts_with('/')) {
        return false;
    }
    let mut chars = p.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_use_lowercase_hex() {
        let mut s = String::new();
        push_json_string(&mut s, "\u{1f}\u{0}\u{b}");
        assert_eq!(s, r#""\u001f\u0000\u000b""#);
    }

    #[test]
    fn pointer_syntax() {
        for ok in ["", "/", "/a", "/a~0b/~1", "/0/1"] {
            assert!(is_json_pointer(ok), "{ok}");
        }
        for bad in ["a", "/a~", "/a~2", "#/a"] {
            assert!(!is_json_pointer(bad), "{bad}");
        }
    }
}
