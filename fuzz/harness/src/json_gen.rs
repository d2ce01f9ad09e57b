//! JSON documents built from fuzzer bytes, and several spellings of each.
//!
//! A [`Node`] is the business value; [`render`] writes it as JSON text with a
//! chosen member order, whitespace, string escaping and number spelling. Every
//! rendering of one node is the same JSON value, so whatever the parsers and the
//! canonical form decide must not depend on which rendering they were given.

use arbitrary::{Result, Unstructured};

/// A decimal `digits × 10^-scale`, with `digits` free of leading zeros (or "0").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Num {
    pub digits: String,
    pub scale: usize,
    pub negative: bool,
}

impl Num {
    /// Equivalent JSON number literals of this value. All stay far inside the
    /// canonical form's bounds (≤ 25 digits, scale ≤ 25).
    pub fn spellings(&self) -> Vec<String> {
        let sign = if self.negative { "-" } else { "" };
        if self.digits == "0" {
            return ["0", "0.0", "0.000", "0e5", "0E-3", "0.0e+2"].iter().map(|s| format!("{sign}{s}")).collect();
        }
        let digits = &self.digits;
        let scale = self.scale;
        let padded = format!("{digits:0>width$}", width = scale + 1);
        let (whole, fraction) = padded.split_at(padded.len() - scale);
        let plain = if fraction.is_empty() { whole.to_string() } else { format!("{whole}.{fraction}") };
        let with_zeros = if fraction.is_empty() { format!("{whole}.000") } else { format!("{whole}.{fraction}00") };
        let (lead, rest) = digits.split_at(1);
        let scientific = if rest.is_empty() {
            format!("{lead}e-{scale}")
        } else {
            let exponent = rest.len() as i64 - scale as i64;
            format!("{lead}.{rest}E{exponent:+}")
        };
        vec![
            format!("{sign}{plain}"),
            format!("{sign}{with_zeros}"),
            format!("{sign}{digits}e-{scale}"),
            format!("{sign}{digits}00E-{}", scale + 2),
            format!("{sign}{scientific}"),
        ]
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Null,
    Bool(bool),
    Num(Num),
    Str(String),
    Arr(Vec<Node>),
    /// Keys are unique.
    Obj(Vec<(String, Node)>),
}

const MAX_GEN_DEPTH: usize = 4;

/// Keys that bound-field pointers are likely to name, plus ones that need escaping.
const KEYS: &[&str] = &["amount", "currency", "payee", "id", "a", "b", "a/b", "m~n", "", "é", "\u{1}", "😀", "\"q\""];

pub fn object(u: &mut Unstructured) -> Result<Node> {
    members(u, 0).map(Node::Obj)
}

pub fn node(u: &mut Unstructured, depth: usize) -> Result<Node> {
    let kinds = if depth >= MAX_GEN_DEPTH { 4 } else { 6 };
    Ok(match u.int_in_range(0..=kinds - 1)? {
        0 => Node::Null,
        1 => Node::Bool(u.arbitrary()?),
        2 => Node::Num(num(u)?),
        3 => Node::Str(u.arbitrary()?),
        4 => {
            let n = u.int_in_range(0..=4)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(node(u, depth + 1)?);
            }
            Node::Arr(items)
        }
        _ => Node::Obj(members(u, depth + 1)?),
    })
}

fn members(u: &mut Unstructured, depth: usize) -> Result<Vec<(String, Node)>> {
    let n = u.int_in_range(0..=5)?;
    let mut out: Vec<(String, Node)> = Vec::with_capacity(n);
    for _ in 0..n {
        let key = if u.ratio(3, 4)? { (*u.choose(KEYS)?).to_string() } else { u.arbitrary()? };
        let value = node(u, depth)?;
        // serde_json's arbitrary_precision marker, refused by design as an object's first key.
        if key != "$serde_json::private::Number" && !out.iter().any(|(k, _)| *k == key) {
            out.push((key, value));
        }
    }
    Ok(out)
}

pub fn num(u: &mut Unstructured) -> Result<Num> {
    let len = u.int_in_range(0..=25)?;
    let mut digits = String::with_capacity(len);
    if len > 0 {
        digits.push(char::from(b'1' + u.int_in_range(0..=8)?));
        for _ in 1..len {
            digits.push(char::from(b'0' + u.int_in_range(0..=9)?));
        }
    } else {
        digits.push('0');
    }
    Ok(Num { digits, scale: u.int_in_range(0..=25)?, negative: u.arbitrary()? })
}

/// How one rendering spells things; `seed` drives member order and number spellings.
#[derive(Debug, Clone)]
pub struct Style {
    pub seed: u64,
    pub whitespace: bool,
    pub escape_all: bool,
    /// Render the value at one of these pointers, if a number, as a decimal string.
    pub stringify: Vec<String>,
    /// Repeat the first member of the n-th non-empty object (render order), with
    /// its key spelled the other way: a duplicate key.
    pub duplicate_in: Option<usize>,
}

impl Style {
    pub fn plain() -> Style {
        Style { seed: 0, whitespace: false, escape_all: false, stringify: Vec::new(), duplicate_in: None }
    }

    fn next(&mut self) -> u64 {
        self.seed = self.seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.seed >> 33
    }
}

pub fn render(node: &Node, style: &mut Style) -> String {
    let mut out = String::new();
    let mut objects = 0;
    let mut path = String::new();
    write(&mut out, node, style, &mut path, &mut objects);
    out
}

/// Number of objects with at least one member (the targets of `duplicate_in`).
pub fn non_empty_objects(node: &Node) -> usize {
    match node {
        Node::Arr(items) => items.iter().map(non_empty_objects).sum(),
        Node::Obj(members) => {
            usize::from(!members.is_empty()) + members.iter().map(|(_, v)| non_empty_objects(v)).sum::<usize>()
        }
        _ => 0,
    }
}

fn space(out: &mut String, style: &mut Style) {
    if style.whitespace {
        out.push_str(match style.next() % 4 {
            0 => " ",
            1 => "\n  ",
            2 => "\t",
            _ => "",
        });
    }
}

fn write(out: &mut String, node: &Node, style: &mut Style, path: &mut String, objects: &mut usize) {
    match node {
        Node::Null => out.push_str("null"),
        Node::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Node::Num(n) => {
            let spellings = n.spellings();
            let pick = (style.next() as usize) % spellings.len();
            let text = spellings.get(pick).map(String::as_str).unwrap_or("0");
            if style.stringify.iter().any(|p| p == path) {
                out.push('"');
                out.push_str(text);
                out.push('"');
            } else {
                out.push_str(text);
            }
        }
        Node::Str(s) => write_string(out, s, style.escape_all),
        Node::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                space(out, style);
                let restore = path.len();
                path.push('/');
                path.push_str(&i.to_string());
                write(out, item, style, path, objects);
                path.truncate(restore);
                space(out, style);
            }
            out.push(']');
        }
        Node::Obj(members) => {
            let duplicate = if members.is_empty() {
                false
            } else {
                let this = *objects;
                *objects += 1;
                style.duplicate_in == Some(this)
            };
            let mut order: Vec<usize> = (0..members.len()).collect();
            for i in (1..order.len()).rev() {
                let j = (style.next() as usize) % (i + 1);
                order.swap(i, j);
            }
            out.push('{');
            let mut first = true;
            for i in order {
                let Some((key, value)) = members.get(i) else { continue };
                member(out, key, value, style, path, objects, &mut first, style.escape_all);
            }
            if duplicate {
                if let Some((key, value)) = members.first() {
                    // The same key, escaped the other way: a parser comparing
                    // raw spellings instead of decoded keys would miss it.
                    let escape = !style.escape_all;
                    member(out, key, value, style, path, objects, &mut first, escape);
                }
            }
            out.push('}');
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn member(
    out: &mut String,
    key: &str,
    value: &Node,
    style: &mut Style,
    path: &mut String,
    objects: &mut usize,
    first: &mut bool,
    escape_key: bool,
) {
    if !*first {
        out.push(',');
    }
    *first = false;
    space(out, style);
    write_string(out, key, escape_key);
    space(out, style);
    out.push(':');
    space(out, style);
    let restore = path.len();
    path.push('/');
    push_pointer_token(path, key);
    write(out, value, style, path, objects);
    path.truncate(restore);
}

/// A JSON string literal; with `escape_all`, every character is written as
/// `\uXXXX` (surrogate pairs above the BMP).
pub fn write_string(out: &mut String, s: &str, escape_all: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            c if escape_all => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            }
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One RFC 6901 reference token (`~` → `~0`, `/` → `~1`).
pub fn push_pointer_token(out: &mut String, token: &str) {
    for c in token.chars() {
        match c {
            '~' => out.push_str("~0"),
            '/' => out.push_str("~1"),
            c => out.push(c),
        }
    }
}

pub fn pointer_token(token: &str) -> String {
    let mut out = String::new();
    push_pointer_token(&mut out, token);
    out
}

/// Pointers of every value in `node` (including "" for the root), in order.
pub fn pointers(node: &Node, path: &mut String, out: &mut Vec<String>) {
    out.push(path.clone());
    let restore = path.len();
    match node {
        Node::Arr(items) => {
            for (i, item) in items.iter().enumerate() {
                path.push('/');
                path.push_str(&i.to_string());
                pointers(item, path, out);
                path.truncate(restore);
            }
        }
        Node::Obj(members) => {
            for (key, value) in members {
                path.push('/');
                push_pointer_token(path, key);
                pointers(value, path, out);
                path.truncate(restore);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_are_json_numbers_of_one_value() {
        for num in [
            Num { digits: "1".into(), scale: 0, negative: false },
            Num { digits: "100".into(), scale: 2, negative: false },
            Num { digits: "12345".into(), scale: 7, negative: true },
            Num { digits: "0".into(), scale: 3, negative: true },
        ] {
            let normal: Vec<Option<String>> =
                num.spellings().iter().map(|s| idem_core::canonical::normalize_decimal(s)).collect();
            assert!(normal.iter().all(|n| n.is_some() && *n == normal[0]), "{num:?}: {normal:?}");
            for s in num.spellings() {
                assert!(serde_json::from_str::<serde_json::Value>(&s).is_ok_and(|v| v.is_number()), "{s}");
            }
        }
        let one = Num { digits: "1".into(), scale: 0, negative: false }.spellings();
        assert!(one.contains(&"1".to_string()) && one.contains(&"1.000".to_string()));
    }

    #[test]
    fn escaped_strings_decode_to_the_original() -> std::result::Result<(), serde_json::Error> {
        for s in ["", "a\"b\\c", "\u{1}\n", "é😀/~"] {
            for escape in [false, true] {
                let mut text = String::new();
                write_string(&mut text, s, escape);
                assert_eq!(serde_json::from_str::<String>(&text)?, s, "{text}");
            }
        }
        Ok(())
    }

    #[test]
    fn duplicates_are_rendered_where_asked() {
        let node = Node::Obj(vec![("a".into(), Node::Obj(vec![("b".into(), Node::Null)]))]);
        assert_eq!(non_empty_objects(&node), 2);
        let mut style = Style { duplicate_in: Some(1), ..Style::plain() };
        assert_eq!(render(&node, &mut style), r#"{"a":{"b":null,"\u0062":null}}"#);
    }
}
