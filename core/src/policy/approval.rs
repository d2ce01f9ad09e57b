//! When a confirm needs a person (DESIGN §4, "Approval"): the route's `approval` annotation.
//!
//! `always`, or a small declarative condition over the route's **bound** fields only, so the
//! decision is covered by the fingerprint: the same fingerprint and arguments always get the same
//! answer, and an agent cannot change whether a person is asked without changing `param_hash`
//! (which is `params_changed`). No general expression language:
//!
//! ```json
//! {"any": [{"field": "/amount", "gte": "1000"},
//!          {"all": [{"field": "/currency", "in": ["JPY", "KRW"]}, {"field": "/amount", "gt": "50000"}]}]}
//! ```
//!
//! - a decimal field (bound `:decimal`, `:integer` or `:number`) compared with a constant:
//!   `gt`, `gte`, `lt`, `lte`, `eq`, exact decimals (never through f64);
//! - a string field (bound `:string`) equal to a constant (`eq`) or in a set (`in`);
//! - `all` / `any` over at most [`MAX_TERMS`] terms, at most [`MAX_DEPTH`] deep.
//!
//! Everything is checked when the configuration loads; a bad condition refuses it, naming the
//! field. A compared field the confirm does not carry (absent or null) counts as met: a person
//! looks rather than a rule failing open.

use super::error::Error;
use crate::canonical::{normalize_decimal, BoundField, FieldType};
use crate::strict_json;
use serde_json::{Map, Value};
use std::cmp::Ordering;

pub const MAX_TERMS: usize = 32;
pub const MAX_DEPTH: usize = 4;
const MAX_SET: usize = 64;
const MAX_CONST_LEN: usize = 256;

/// A route's approval rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Approval {
    Always,
    When(Condition),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    All(Vec<Condition>),
    Any(Vec<Condition>),
    /// A decimal field against a constant (the constant in canonical decimal text).
    Compare {
        pointer: String,
        op: CompareOp,
        value: String,
    },
    /// A string field equal to one of these (one element for `eq`).
    OneOf {
        pointer: String,
        values: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    Gt,
    Gte,
    Lt,
    Lte,
    Eq,
}

impl CompareOp {
    fn parse(name: &str) -> Option<CompareOp> {
        Some(match name {
            "gt" => CompareOp::Gt,
            "gte" => CompareOp::Gte,
            "lt" => CompareOp::Lt,
            "lte" => CompareOp::Lte,
            "eq" => CompareOp::Eq,
            _ => return None,
        })
    }

    fn holds(self, o: Ordering) -> bool {
        match self {
            CompareOp::Gt => o == Ordering::Greater,
            CompareOp::Gte => o != Ordering::Less,
            CompareOp::Lt => o == Ordering::Less,
            CompareOp::Lte => o != Ordering::Greater,
            CompareOp::Eq => o == Ordering::Equal,
        }
    }
}

fn perr<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error(msg.into()))
}

/// Parse the `approval` leaf against the route's bound fields. Errors start with `approval`
/// and name the offending field or pointer.
pub fn parse(text: &str, bound: &[BoundField]) -> Result<Approval, Error> {
    if text.trim() == "always" {
        return Ok(Approval::Always);
    }
    let value = match strict_json::from_slice(text.as_bytes()) {
        Ok(v @ Value::Object(_)) => v,
        Ok(Value::String(s)) if s == "always" => return Ok(Approval::Always),
        _ => return perr(
            "approval: expected \"always\" or a condition object such as {\"field\": \"/amount\", \"gte\": \"1000\"}",
        ),
    };
    let mut terms = 0;
    parse_condition(&value, bound, 0, &mut terms, "approval").map(Approval::When)
}

fn parse_condition(
    value: &Value,
    bound: &[BoundField],
    depth: usize,
    terms: &mut usize,
    at: &str,
) -> Result<Condition, Error> {
    *terms += 1;
    if *terms > MAX_TERMS {
        return perr(format!("{at}: more than {MAX_TERMS} terms"));
    }
    if depth >= MAX_DEPTH {
        return perr(format!("{at}: nested deeper than {MAX_DEPTH} levels"));
    }
    let Value::Object(map) = value else {
        return perr(format!("{at}: expected an object (all, any, or a field comparison)"));
    };
    for combinator in ["all", "any"] {
        let Some(list) = map.get(combinator) else { continue };
        if map.len() != 1 {
            return perr(format!("{at}: {combinator} stands alone in its object"));
        }
        let Value::Array(items) = list else {
            return perr(format!("{at}.{combinator}: expected a non-empty array of conditions"));
        };
        if items.is_empty() {
            return perr(format!("{at}.{combinator}: expected a non-empty array of conditions"));
        }
        let mut parsed = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            parsed.push(parse_condition(item, bound, depth + 1, terms, &format!("{at}.{combinator}[{i}]"))?);
        }
        return Ok(if combinator == "all" { Condition::All(parsed) } else { Condition::Any(parsed) });
    }
    parse_term(map, bound, at)
}

fn parse_term(map: &Map<String, Value>, bound: &[BoundField], at: &str) -> Result<Condition, Error> {
    let Some(Value::String(pointer)) = map.get("field") else {
        return perr(format!("{at}.field: required, the JSON pointer of one of the route's bound fields"));
    };
    let Some(field) = bound.iter().find(|f| f.pointer == *pointer) else {
        return perr(format!(
            "{at}.field: {pointer:?} is not one of the route's bound fields (bind): a condition may read only what the fingerprint covers"
        ));
    };
    if field.source != crate::canonical::Source::Body {
        // The condition reads the body; a value outside it would always read as absent (met).
        return perr(format!("{at}.field: {pointer:?}: a condition reads the body's bound fields only"));
    }
    let ops: Vec<&String> = map.keys().filter(|k| k.as_str() != "field").collect();
    let [op] = ops.as_slice() else {
        return perr(format!("{at} ({pointer}): expected exactly one of gt, gte, lt, lte, eq, in"));
    };
    let constant = map.get(op.as_str()).unwrap_or(&Value::Null);
    let numeric = field.decimal || matches!(field.ty, FieldType::Decimal | FieldType::Integer | FieldType::Number);
    let string = field.ty == FieldType::String;
    let text_const = |v: &Value| -> Option<String> {
        match v {
            Value::String(s) if !s.is_empty() && s.len() <= MAX_CONST_LEN => Some(s.clone()),
            _ => None,
        }
    };
    if op.as_str() == "in" {
        if !string {
            return perr(format!("{at}.in ({pointer}): a set is for a field bound as :string"));
        }
        let Value::Array(items) = constant else {
            return perr(format!("{at}.in ({pointer}): expected an array of 1 to {MAX_SET} strings"));
        };
        let values: Option<Vec<String>> = items.iter().map(text_const).collect();
        match values {
            Some(v) if !v.is_empty() && v.len() <= MAX_SET => {
                return Ok(Condition::OneOf { pointer: pointer.clone(), values: v })
            }
            _ => return perr(format!("{at}.in ({pointer}): expected an array of 1 to {MAX_SET} strings")),
        }
    }
    let Some(cmp) = CompareOp::parse(op) else {
        return perr(format!("{at}.{op} ({pointer}): unknown operator (expected gt, gte, lt, lte, eq or in)"));
    };
    if numeric {
        let literal = match constant {
            Value::Number(n) => Some(n.to_string()),
            Value::String(s) => Some(s.clone()),
            _ => None,
        };
        return match literal.as_deref().and_then(normalize_decimal) {
            Some(value) => Ok(Condition::Compare { pointer: pointer.clone(), op: cmp, value }),
            None => perr(format!("{at}.{op} ({pointer}): expected a decimal constant such as \"1000.00\"")),
        };
    }
    if string && cmp == CompareOp::Eq {
        return match text_const(constant) {
            Some(v) => Ok(Condition::OneOf { pointer: pointer.clone(), values: vec![v] }),
            None => perr(format!("{at}.eq ({pointer}): expected a non-empty string")),
        };
    }
    perr(format!(
        "{at}.{op} ({pointer}): the field must be bound as :decimal (or :integer, :number) to compare, or :string for eq and in"
    ))
}

impl Approval {
    /// Whether this confirm (its parsed body) needs a person.
    pub fn required(&self, body: &Value) -> bool {
        match self {
            Approval::Always => true,
            Approval::When(c) => c.holds(body),
        }
    }
}

impl Condition {
    pub fn holds(&self, body: &Value) -> bool {
        match self {
            Condition::All(items) => items.iter().all(|c| c.holds(body)),
            Condition::Any(items) => items.iter().any(|c| c.holds(body)),
            Condition::Compare { pointer, op, value } => match body.pointer(pointer) {
                None | Some(Value::Null) => true,
                Some(v) => {
                    let literal = match v {
                        Value::Number(n) => Some(n.to_string()),
                        Value::String(s) => Some(s.clone()),
                        _ => None,
                    };
                    // An unreadable value never reaches here on a confirm (the bound field's type is
                    // checked first); if it did, a person looks.
                    match literal.as_deref().and_then(normalize_decimal) {
                        Some(normal) => op.holds(cmp_decimal(&normal, value)),
                        None => true,
                    }
                }
            },
            Condition::OneOf { pointer, values } => match body.pointer(pointer) {
                None | Some(Value::Null) => true,
                Some(Value::String(s)) => values.iter().any(|v| v == s),
                Some(_) => true,
            },
        }
    }
}

/// Order two canonical decimals (`normalize_decimal`'s text: no exponent, no leading zeros, no
/// trailing fraction zeros, `0` for zero).
pub fn cmp_decimal(a: &str, b: &str) -> Ordering {
    let (neg_a, mag_a) = a.strip_prefix('-').map_or((false, a), |m| (true, m));
    let (neg_b, mag_b) = b.strip_prefix('-').map_or((false, b), |m| (true, m));
    match (neg_a, neg_b) {
        (false, true) => Ordering::Greater,
        (true, false) => Ordering::Less,
        (false, false) => cmp_magnitude(mag_a, mag_b),
        (true, true) => cmp_magnitude(mag_b, mag_a),
    }
}

fn cmp_magnitude(a: &str, b: &str) -> Ordering {
    let (int_a, frac_a) = a.split_once('.').unwrap_or((a, ""));
    let (int_b, frac_b) = b.split_once('.').unwrap_or((b, ""));
    // Canonical integer parts have no leading zeros, so the longer one is larger.
    int_a.len().cmp(&int_b.len()).then_with(|| int_a.cmp(int_b)).then_with(|| frac_a.cmp(frac_b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound() -> Vec<BoundField> {
        vec![
            BoundField::typed("/amount", FieldType::Decimal),
            BoundField::typed("/currency", FieldType::String),
            BoundField::typed("/payee_id", FieldType::Any),
        ]
    }

    fn when(text: &str) -> Result<Approval, Error> {
        parse(text, &bound())
    }

    #[test]
    fn decimals_order_exactly() {
        let n = |s: &str| normalize_decimal(s).unwrap_or_default();
        for (a, b, o) in [
            ("1000", "999.99", Ordering::Greater),
            ("1000.00", "1e3", Ordering::Equal),
            ("-1", "0", Ordering::Less),
            ("-10", "-9", Ordering::Less),
            ("0.001", "0.01", Ordering::Less),
            ("12345678901234567890.01", "12345678901234567890.009", Ordering::Greater),
            ("-0.0", "0", Ordering::Equal),
        ] {
            assert_eq!(cmp_decimal(&n(a), &n(b)), o, "{a} vs {b}");
        }
    }

    #[test]
    fn always_and_conditions_decide_over_the_body() -> Result<(), Error> {
        assert_eq!(when("always")?, Approval::Always);
        assert_eq!(when("\"always\"")?, Approval::Always);
        let big = when(r#"{"field":"/amount","gte":"1000.00"}"#)?;
        assert!(big.required(&serde_json::json!({"amount": "1000"})));
        assert!(big.required(&serde_json::json!({"amount": 1e3})));
        assert!(!big.required(&serde_json::json!({"amount": "999.999"})));
        // Absent: a person looks.
        assert!(big.required(&serde_json::json!({})));
        let any = when(
            r#"{"any":[{"field":"/amount","gt":5000},{"all":[{"field":"/currency","in":["JPY","KRW"]},{"field":"/amount","gt":"100"}]}]}"#,
        )?;
        assert!(any.required(&serde_json::json!({"amount": "5000.01", "currency": "EUR"})));
        assert!(!any.required(&serde_json::json!({"amount": "5000", "currency": "EUR"})));
        assert!(any.required(&serde_json::json!({"amount": "101", "currency": "JPY"})));
        assert!(!any.required(&serde_json::json!({"amount": "100", "currency": "JPY"})));
        let eur = when(r#"{"field":"/currency","eq":"EUR"}"#)?;
        assert!(eur.required(&serde_json::json!({"currency": "EUR"})));
        assert!(!eur.required(&serde_json::json!({"currency": "eur"})));
        Ok(())
    }

    #[test]
    fn bad_conditions_name_the_field() {
        for (text, names) in [
            (r#"{"field":"/memo","gt":"1"}"#, "/memo"),
            (r#"{"field":"/amount","gt":"lots"}"#, "approval.gt (/amount)"),
            (r#"{"field":"/amount","in":["1"]}"#, "approval.in (/amount)"),
            (r#"{"field":"/currency","gt":"1"}"#, "approval.gt (/currency)"),
            (r#"{"field":"/payee_id","eq":"x"}"#, "approval.eq (/payee_id)"),
            (r#"{"field":"/amount","gt":"1","lt":"2"}"#, "(/amount)"),
            (r#"{"field":"/amount","between":"1"}"#, "approval.between"),
            (r#"{"any":[]}"#, "approval.any"),
            (r#"{"all":[{"field":"/x","eq":"1"}]}"#, "approval.all[0].field"),
            (r#"{"any":[{"any":[{"any":[{"any":[{"field":"/amount","gt":1}]}]}]}]}"#, "deeper"),
            ("sometimes", "approval:"),
            (r#"{"field":"/currency","in":[]}"#, "approval.in (/currency)"),
            (r#"{"field":"/currency","in":[1]}"#, "approval.in (/currency)"),
        ] {
            match when(text) {
                Ok(a) => panic!("{text} parsed as {a:?}"),
                Err(Error(e)) => assert!(e.contains(names), "{text}: {e}"),
            }
        }
    }
}
