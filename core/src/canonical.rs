//! Canonical JSON of a route's bound fields and its `param_hash` (DESIGN §3).
//!
//! The hash must not change when an agent re-spells the same business values
//! (`1.0` vs `1.00`, key order, whitespace) and must change when any bound value
//! changes. Numbers never pass through f64: money has more digits than a double.

use crate::json_text::{push_json_string, push_pointer_token};
use crate::strict_json;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;

/// One bound field: a JSON pointer into the request body, or a value outside it (a path
/// template's parameter, a query parameter, a header), named `path:account`, `query:currency` or
/// `header:x-tenant-id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundField {
    /// The pointer (`/amount`), or the outside value's name with its source (`path:account`):
    /// also its member name in the canonical JSON, where the two can never collide (a pointer
    /// starts with `/`).
    pub pointer: String,
    /// Accept a number or a decimal string and hash both as the same number.
    pub decimal: bool,
    /// The declared JSON type (`/currency:string`): checked, and what tool
    /// definitions generated from the annotation say about the argument.
    pub ty: FieldType,
    pub source: Source,
}

/// Where a bound value is read (DESIGN §3, "Binding outside the body").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Body,
    /// `path:NAME`: the route template's `{NAME}` segment, exactly as sent.
    Path,
    /// `query:NAME`: the query parameter, exactly as sent.
    Query,
    /// `header:NAME`: the request header (name in lower case).
    Header,
}

impl Source {
    pub const OUTSIDE: [(Source, &'static str); 3] =
        [(Source::Path, "path:"), (Source::Query, "query:"), (Source::Header, "header:")];

    pub fn prefix(self) -> &'static str {
        match self {
            Source::Body => "",
            Source::Path => "path:",
            Source::Query => "query:",
            Source::Header => "header:",
        }
    }
}

/// The values of a request's bound fields outside its body, each under its field's `pointer`
/// (`path:account`), as read from the request (an absent one is not here).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outside(pub Vec<(String, String)>);

impl Outside {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// A bound field's declared type (`bind: "/amount:decimal, /currency:string"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldType {
    /// Undeclared: any JSON value, hashed canonically.
    Any,
    /// A number or a decimal string, hashed as the same number.
    Decimal,
    String,
    /// A number without fraction or exponent.
    Integer,
    Number,
    Boolean,
}

impl FieldType {
    pub fn suffix(self) -> Option<&'static str> {
        match self {
            FieldType::Any => None,
            FieldType::Decimal => Some("decimal"),
            FieldType::String => Some("string"),
            FieldType::Integer => Some("integer"),
            FieldType::Number => Some("number"),
            FieldType::Boolean => Some("boolean"),
        }
    }

    pub fn from_suffix(s: &str) -> Option<FieldType> {
        [FieldType::Decimal, FieldType::String, FieldType::Integer, FieldType::Number, FieldType::Boolean]
            .into_iter()
            .find(|t| t.suffix() == Some(s))
    }

    fn admits(self, value: &Value) -> bool {
        match self {
            FieldType::Any | FieldType::Decimal => true,
            FieldType::String => value.is_string(),
            FieldType::Number => value.is_number(),
            FieldType::Integer => {
                value.as_number().is_some_and(|n| n.to_string().bytes().all(|b| b.is_ascii_digit() || b == b'-'))
            }
            FieldType::Boolean => value.is_boolean(),
        }
    }
}

impl BoundField {
    pub fn new(pointer: &str, decimal: bool) -> BoundField {
        let ty = if decimal { FieldType::Decimal } else { FieldType::Any };
        BoundField { pointer: pointer.to_string(), decimal, ty, source: Source::Body }
    }

    pub fn typed(pointer: &str, ty: FieldType) -> BoundField {
        BoundField { pointer: pointer.to_string(), decimal: ty == FieldType::Decimal, ty, source: Source::Body }
    }

    /// A value outside the body: `name` (a header's in lower case) read from `source`.
    pub fn outside(source: Source, name: &str, ty: FieldType) -> BoundField {
        let pointer = format!("{}{name}", source.prefix());
        BoundField { pointer, decimal: ty == FieldType::Decimal, ty, source }
    }

    /// The outside value's name (`account` of `path:account`); the pointer of a body field.
    pub fn name(&self) -> &str {
        self.pointer.strip_prefix(self.source.prefix()).unwrap_or(&self.pointer)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    TooLarge { limit: usize },
    Invalid(String),
    NotAnObject,
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::TooLarge { limit } => write!(f, "body larger than {limit} bytes"),
            BodyError::Invalid(why) => write!(f, "body is not valid JSON: {why}"),
            BodyError::NotAnObject => f.write_str("body is not a JSON object"),
        }
    }
}

impl std::error::Error for BodyError {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonError {
    /// `pointer` names the offending value, which may lie inside a bound field.
    WrongType {
        pointer: String,
        expected: &'static str,
    },
    NumberOutOfRange {
        pointer: String,
    },
    TooDeep {
        pointer: String,
    },
    /// A bound value outside the body came more than once (a query parameter, a header): which
    /// one the upstream reads is not ours to guess (DESIGN §6, repeated values).
    Repeated {
        pointer: String,
    },
    /// A bound header whose value is not text (not UTF-8).
    NotText {
        pointer: String,
    },
}

impl CanonError {
    pub fn pointer(&self) -> &str {
        match self {
            CanonError::WrongType { pointer, .. }
            | CanonError::NumberOutOfRange { pointer }
            | CanonError::TooDeep { pointer }
            | CanonError::Repeated { pointer }
            | CanonError::NotText { pointer } => pointer,
        }
    }
}

impl fmt::Display for CanonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CanonError::WrongType { pointer, expected } => write!(f, "{pointer}: expected a {expected}"),
            CanonError::NumberOutOfRange { pointer } => write!(
                f,
                "{pointer}: number out of range (at most {MAX_LITERAL_LEN} characters, exponent within ±{MAX_EXPONENT}, {MAX_DIGITS} digits)"
            ),
            CanonError::TooDeep { pointer } => write!(f, "{pointer}: nested deeper than {MAX_DEPTH} levels"),
            CanonError::Repeated { pointer } => {
                write!(f, "{pointer}: sent more than once (a bound value must be sent once)")
            }
            CanonError::NotText { pointer } => write!(f, "{pointer}: not text (its value is not UTF-8)"),
        }
    }
}

impl std::error::Error for CanonError {}

/// Bounds that keep a hostile number (`1e999999999`) cheap to reject.
pub const MAX_LITERAL_LEN: usize = 100;
pub const MAX_EXPONENT: u32 = 100;
pub const MAX_DIGITS: usize = 200;
/// Deeper than any real tool argument; bounds the recursion.
pub const MAX_DEPTH: usize = 32;

/// Parse a request/response body: reject over `max_bytes` BEFORE parsing,
/// reject non-JSON (including duplicate object keys), require a top-level object.
pub fn parse_json_body(bytes: &[u8], max_bytes: usize) -> Result<Value, BodyError> {
    if bytes.len() > max_bytes {
        return Err(BodyError::TooLarge { limit: max_bytes });
    }
    let value = strict_json::from_slice(bytes).map_err(BodyError::Invalid)?;
    if value.is_object() {
        Ok(value)
    } else {
        Err(BodyError::NotAnObject)
    }
}

/// Canonical JSON text of the bound fields, keyed by their pointer strings. Only the body's: a
/// route that binds values outside it hashes with [`canonical_request`].
pub fn canonical_params(body: &Value, fields: &[BoundField]) -> Result<String, CanonError> {
    canonical_request(body, &Outside::default(), fields)
}

/// Canonical JSON text of the bound fields, from the body and (`path:`, `query:`, `header:`) the
/// values outside it, each a string hashed by the same rules as a body field (exact, or as a
/// decimal where declared one).
pub fn canonical_request(body: &Value, outside: &Outside, fields: &[BoundField]) -> Result<String, CanonError> {
    let mut members: BTreeMap<&str, String> = BTreeMap::new();
    for field in fields {
        let read;
        let value = match field.source {
            Source::Body => body.pointer(&field.pointer),
            _ => {
                read = outside.get(&field.pointer).map(|v| Value::String(v.to_owned()));
                read.as_ref()
            }
        };
        let Some(value) = value else { continue };
        if value.is_null() {
            continue;
        }
        if !field.ty.admits(value) {
            let expected = field.ty.suffix().unwrap_or("value");
            return Err(CanonError::WrongType { pointer: field.pointer.clone(), expected });
        }
        let mut text = String::new();
        if field.decimal {
            push_decimal_field(&mut text, value, &field.pointer)?;
        } else {
            let mut path = field.pointer.clone();
            push_canonical(&mut text, value, &mut path, 0)?;
        }
        members.insert(field.pointer.as_str(), text);
    }
    // BTreeMap<&str> iterates in byte order, which for UTF-8 is code point order.
    let mut out = String::from("{");
    for (i, (key, text)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_string(&mut out, key);
        out.push(':');
        out.push_str(text);
    }
    out.push('}');
    Ok(out)
}

/// Lowercase hex SHA-256 of [`canonical_params`].
pub fn param_hash(body: &Value, fields: &[BoundField]) -> Result<String, CanonError> {
    request_hash(body, &Outside::default(), fields)
}

/// Lowercase hex SHA-256 of [`canonical_request`].
pub fn request_hash(body: &Value, outside: &Outside, fields: &[BoundField]) -> Result<String, CanonError> {
    let text = canonical_request(body, outside, fields)?;
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
}

/// Normalize a decimal literal ("100e-2", "1.00", "-0.0", "1E+3") to its
/// canonical text ("1", "1", "0", "1000"). `None` if it is not a decimal
/// literal or exceeds the bounds.
pub fn normalize_decimal(text: &str) -> Option<String> {
    parse_decimal(text).ok()
}

fn push_decimal_field(out: &mut String, value: &Value, pointer: &str) -> Result<(), CanonError> {
    let literal = match value {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => return Err(CanonError::WrongType { pointer: pointer.to_string(), expected: "decimal" }),
    };
    match parse_decimal(&literal) {
        Ok(normal) => {
            out.push_str(&normal);
            Ok(())
        }
        Err(DecimalError::OutOfRange) => Err(CanonError::NumberOutOfRange { pointer: pointer.to_string() }),
        Err(DecimalError::Syntax) => Err(CanonError::WrongType { pointer: pointer.to_string(), expected: "decimal" }),
    }
}

/// `path` is the pointer of `value`, extended in place while descending so an
/// error can name exactly where it happened.
fn push_canonical(out: &mut String, value: &Value, path: &mut String, depth: usize) -> Result<(), CanonError> {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::String(s) => push_json_string(out, s),
        Value::Number(n) => match parse_decimal(&n.to_string()) {
            Ok(normal) => out.push_str(&normal),
            // serde_json only yields valid literals, so any failure is a bound.
            Err(_) => return Err(CanonError::NumberOutOfRange { pointer: path.clone() }),
        },
        Value::Array(items) => {
            if depth >= MAX_DEPTH {
                return Err(CanonError::TooDeep { pointer: path.clone() });
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let restore = path.len();
                path.push('/');
                path.push_str(&i.to_string());
                push_canonical(out, item, path, depth + 1)?;
                path.truncate(restore);
            }
            out.push(']');
        }
        Value::Object(map) => {
            if depth >= MAX_DEPTH {
                return Err(CanonError::TooDeep { pointer: path.clone() });
            }
            let mut keys: Vec<&String> = map.iter().filter(|(_, v)| !v.is_null()).map(|(k, _)| k).collect();
            keys.sort_unstable();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                let Some(member) = map.get(key) else { continue };
                if i > 0 {
                    out.push(',');
                }
                push_json_string(out, key);
                out.push(':');
                let restore = path.len();
                path.push('/');
                push_pointer_token(path, key);
                push_canonical(out, member, path, depth + 1)?;
                path.truncate(restore);
            }
            out.push('}');
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecimalError {
    Syntax,
    OutOfRange,
}

/// JSON number grammar, except that leading zeros in the integer part are
/// tolerated (a decimal *string* such as "007.50" is still unambiguous).
fn parse_decimal(text: &str) -> Result<String, DecimalError> {
    if text.len() > MAX_LITERAL_LEN {
        return Err(DecimalError::OutOfRange);
    }
    let bytes = text.as_bytes();
    let mut i = 0;
    let negative = bytes.first() == Some(&b'-');
    if negative {
        i += 1;
    }
    let int_start = i;
    while bytes.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    let int_digits = text.get(int_start..i).ok_or(DecimalError::Syntax)?;
    if int_digits.is_empty() {
        return Err(DecimalError::Syntax);
    }
    let mut frac_digits = "";
    if bytes.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while bytes.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        frac_digits = text.get(start..i).ok_or(DecimalError::Syntax)?;
        if frac_digits.is_empty() {
            return Err(DecimalError::Syntax);
        }
    }
    let mut exponent: i64 = 0;
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        i += 1;
        let exp_negative = match bytes.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let start = i;
        while bytes.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        let digits = text.get(start..i).ok_or(DecimalError::Syntax)?;
        if digits.is_empty() {
            return Err(DecimalError::Syntax);
        }
        let significant = digits.trim_start_matches('0');
        // Checked on the text so a huge exponent is never even parsed.
        if significant.len() > 3 {
            return Err(DecimalError::OutOfRange);
        }
        let magnitude: i64 =
            if significant.is_empty() { 0 } else { significant.parse().map_err(|_| DecimalError::Syntax)? };
        if magnitude > i64::from(MAX_EXPONENT) {
            return Err(DecimalError::OutOfRange);
        }
        exponent = if exp_negative { -magnitude } else { magnitude };
    }
    if i != bytes.len() {
        return Err(DecimalError::Syntax);
    }

    // value = digits × 10^(exponent − len(frac)), with digits = int ++ frac.
    let mut digits = String::with_capacity(int_digits.len() + frac_digits.len());
    digits.push_str(int_digits);
    digits.push_str(frac_digits);
    let significant = digits.trim_start_matches('0');
    if significant.is_empty() {
        return Ok("0".to_string());
    }
    let trimmed = significant.trim_end_matches('0');
    let dropped = significant.len() - trimmed.len();
    // All lengths are ≤ MAX_LITERAL_LEN, so these casts cannot overflow.
    let scale = exponent - frac_digits.len() as i64 + dropped as i64;
    let n = trimmed.len() as i64;

    // Size the output before building it: never allocate by the exponent.
    let total_digits = if scale >= 0 { n + scale } else { n.max(-scale + 1) };
    if total_digits > MAX_DIGITS as i64 {
        return Err(DecimalError::OutOfRange);
    }
    // The canonical text must itself be an accepted literal, or one value would
    // hash in one spelling (`3e100`) and be refused written out (a fixed point).
    let text_len = total_digits + i64::from(negative) + i64::from(scale < 0);
    if text_len > MAX_LITERAL_LEN as i64 {
        return Err(DecimalError::OutOfRange);
    }
    let mut out = String::with_capacity(total_digits as usize + 2);
    if negative {
        out.push('-');
    }
    if scale >= 0 {
        out.push_str(trimmed);
        out.extend(std::iter::repeat_n('0', scale as usize));
    } else {
        let point = n + scale;
        if point > 0 {
            let (whole, fraction) = trimmed.split_at(point as usize);
            out.push_str(whole);
            out.push('.');
            out.push_str(fraction);
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(trimmed);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(text: &str) -> Result<Value, BodyError> {
        parse_json_body(text.as_bytes(), 65536)
    }

    fn fields(spec: &[(&str, bool)]) -> Vec<BoundField> {
        spec.iter().map(|(p, d)| BoundField::new(p, *d)).collect()
    }

    #[test]
    fn decimals_normalize() {
        let cases = [
            ("100e-2", "1"),
            ("1.00", "1"),
            ("1", "1"),
            ("1.0", "1"),
            ("-0.0", "0"),
            ("-0", "0"),
            ("0e5", "0"),
            ("1E+3", "1000"),
            ("1e3", "1000"),
            ("12.3400", "12.34"),
            ("-12.34e1", "-123.4"),
            ("0.001", "0.001"),
            ("1e-3", "0.001"),
            ("007.50", "7.5"),
            ("123456789012345678901234567890.000000000000000001", "123456789012345678901234567890.000000000000000001"),
        ];
        for (input, want) in cases {
            assert_eq!(normalize_decimal(input).as_deref(), Some(want), "{input}");
        }
        // The longest canonical text is itself an accepted literal (≤ 100 characters).
        let tiny = normalize_decimal("5e-98");
        assert_eq!(tiny.as_deref().map(str::len), Some(100));
        assert!(tiny.is_some_and(|t| t.starts_with("0.000") && t.ends_with('5')));
        assert_eq!(normalize_decimal("5e-99"), None);
    }

    #[test]
    fn decimal_syntax_is_strict() {
        for bad in
            ["", "-", "+1", "1.", ".5", "1e", "1e+", "0x10", "1,0", " 1", "1 ", "NaN", "Infinity", "1.2.3", "--1", "١"]
        {
            assert_eq!(normalize_decimal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn hostile_numbers_are_rejected_cheaply() {
        assert_eq!(parse_decimal("1e999999999"), Err(DecimalError::OutOfRange));
        assert_eq!(parse_decimal("1e101"), Err(DecimalError::OutOfRange));
        assert_eq!(parse_decimal("1e-101"), Err(DecimalError::OutOfRange));
        assert_eq!(parse_decimal("1e0000000000000000099"), Ok(format!("1{}", "0".repeat(99))));
        assert_eq!(parse_decimal("1e0000000000000000100"), Err(DecimalError::OutOfRange));
        assert_eq!(parse_decimal(&"1".repeat(101)), Err(DecimalError::OutOfRange));
        let long = format!("{}e5", "9".repeat(95));
        assert_eq!(parse_decimal(&long), Ok(format!("{}{}", "9".repeat(95), "0".repeat(5))));
        assert_eq!(parse_decimal(&format!("{}e6", "9".repeat(95))), Err(DecimalError::OutOfRange));
        let small = format!("0.{}1e-100", "0".repeat(92));
        assert_eq!(parse_decimal(&small), Err(DecimalError::OutOfRange), "195 characters written out");
        let b = body(r#"{"amount": 1e999999999}"#);
        assert!(matches!(b, Ok(ref v) if matches!(
            param_hash(v, &fields(&[("/amount", false)])),
            Err(CanonError::NumberOutOfRange { ref pointer }) if pointer == "/amount"
        )));
    }

    #[test]
    fn canonical_text_sorts_and_drops_nulls() -> Result<(), Box<dyn std::error::Error>> {
        let b = body(r#"{"currency":"USD","amount":100.50,"memo":"ASAP","payee":null}"#)?;
        let f = fields(&[("/currency", false), ("/amount", true), ("/payee", false), ("/missing", false)]);
        assert_eq!(canonical_params(&b, &f)?, r#"{"/amount":100.5,"/currency":"USD"}"#);
        assert_eq!(canonical_params(&b, &[])?, "{}");
        Ok(())
    }

    #[test]
    fn free_text_drift_does_not_change_the_hash() -> Result<(), Box<dyn std::error::Error>> {
        let f = fields(&[("/amount", true), ("/currency", false)]);
        let a = body(r#"{"amount":"1.00","currency":"USD","memo":"ASAP"}"#)?;
        let b = body(r#"{ "memo" : "please ASAP", "currency":"USD", "amount": 100e-2 }"#)?;
        assert_eq!(param_hash(&a, &f)?, param_hash(&b, &f)?);
        let c = body(r#"{"amount":"1.01","currency":"USD"}"#)?;
        assert_ne!(param_hash(&a, &f)?, param_hash(&c, &f)?);
        Ok(())
    }

    #[test]
    fn strings_and_numbers_differ_unless_declared_decimal() -> Result<(), Box<dyn std::error::Error>> {
        let f = fields(&[("/amount", false)]);
        let a = body(r#"{"amount":"1.00"}"#)?;
        let b = body(r#"{"amount":1}"#)?;
        assert_ne!(param_hash(&a, &f)?, param_hash(&b, &f)?);
        assert_eq!(canonical_params(&a, &f)?, r#"{"/amount":"1.00"}"#);
        Ok(())
    }

    #[test]
    fn decimal_fields_reject_other_types() -> Result<(), Box<dyn std::error::Error>> {
        let f = fields(&[("/amount", true)]);
        for text in [r#"{"amount":true}"#, r#"{"amount":"ten"}"#, r#"{"amount":[1]}"#, r#"{"amount":{"v":1}}"#] {
            let b = body(text)?;
            assert_eq!(
                canonical_params(&b, &f),
                Err(CanonError::WrongType { pointer: "/amount".into(), expected: "decimal" }),
                "{text}"
            );
        }
        let b = body(r#"{"amount":"1e500"}"#)?;
        assert_eq!(canonical_params(&b, &f), Err(CanonError::NumberOutOfRange { pointer: "/amount".into() }));
        Ok(())
    }

    #[test]
    fn nested_values_are_canonical() -> Result<(), Box<dyn std::error::Error>> {
        let f = fields(&[("/items", false), ("/payee", false)]);
        let b = body(r#"{"payee":{"z":1.0,"a":"x","n":null,"ok":true},"items":[2.50,null,{"b":1,"a":[]}]}"#)?;
        assert_eq!(
            canonical_params(&b, &f)?,
            r#"{"/items":[2.5,null,{"a":[],"b":1}],"/payee":{"a":"x","ok":true,"z":1}}"#
        );
        Ok(())
    }

    #[test]
    fn errors_name_the_nested_location() -> Result<(), Box<dyn std::error::Error>> {
        let b = body(r#"{"payee":{"a/b":[0, 1e300]}}"#)?;
        let e = canonical_params(&b, &fields(&[("/payee", false)]));
        assert_eq!(e, Err(CanonError::NumberOutOfRange { pointer: "/payee/a~1b/1".into() }));
        Ok(())
    }

    #[test]
    fn nesting_is_bounded() -> Result<(), Box<dyn std::error::Error>> {
        let ok = format!(r#"{{"x":{}1{}}}"#, "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        let f = fields(&[("/x", false)]);
        assert!(canonical_params(&body(&ok)?, &f).is_ok());
        let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(matches!(canonical_params(&body(&deep)?, &f), Err(CanonError::TooDeep { .. })));
        Ok(())
    }

    #[test]
    fn strings_are_escaped_as_jcs() -> Result<(), Box<dyn std::error::Error>> {
        let b = json!({"s": "a\"b\\c\u{0001}\n\u{7f}é\u{2028}😀"});
        let text = canonical_params(&b, &fields(&[("/s", false)]))?;
        assert_eq!(text, "{\"/s\":\"a\\\"b\\\\c\\u0001\\n\u{7f}é\u{2028}😀\"}");
        Ok(())
    }

    #[test]
    fn pointers_follow_rfc6901() -> Result<(), Box<dyn std::error::Error>> {
        let b = body(r#"{"a/b":1,"m~n":2,"list":[10,20]}"#)?;
        let f = fields(&[("/a~1b", false), ("/m~0n", false), ("/list/1", false), ("/list/01", false)]);
        assert_eq!(canonical_params(&b, &f)?, r#"{"/a~1b":1,"/list/1":20,"/m~0n":2}"#);
        Ok(())
    }

    #[test]
    fn bodies_are_checked_before_and_after_parsing() {
        assert_eq!(parse_json_body(b"{\"a\":1}", 3), Err(BodyError::TooLarge { limit: 3 }));
        assert_eq!(parse_json_body(b"[1]", 10), Err(BodyError::NotAnObject));
        assert_eq!(parse_json_body(b"\"x\"", 10), Err(BodyError::NotAnObject));
        assert!(matches!(parse_json_body(b"{\"a\":", 10), Err(BodyError::Invalid(_))));
        assert!(matches!(parse_json_body(b"\xff", 10), Err(BodyError::Invalid(_))));
        assert!(matches!(parse_json_body(b"", 10), Err(BodyError::Invalid(_))));
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        // The upstream may read the first "amount" while a last-wins parser hashes the second.
        let e = parse_json_body(br#"{"amount":1,"amount":1000}"#, 100);
        assert!(matches!(e, Err(BodyError::Invalid(ref m)) if m.contains("amount")), "{e:?}");
        let nested = parse_json_body(br#"{"p":{"id":1,"id":2}}"#, 100);
        assert!(matches!(nested, Err(BodyError::Invalid(_))));
    }

    /// Found by fuzzing (fuzz/regressions/param_hash): a canonical number is
    /// always an accepted literal, so canonicalising is a fixed point.
    #[test]
    fn canonical_numbers_parse_again() {
        for text in ["3e100", "1e99", "-9.9e98", "1e-98"] {
            if let Some(normal) = normalize_decimal(text) {
                assert_eq!(normalize_decimal(&normal).as_deref(), Some(normal.as_str()), "{text}");
            }
        }
        assert_eq!(normalize_decimal("3e100"), None, "too long written out");
        assert!(normalize_decimal("3e98").is_some());
    }
}
