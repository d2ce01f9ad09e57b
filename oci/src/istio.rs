//! What istiod makes of a WasmPlugin's `pluginConfig`.
//!
//! `pluginConfig` is a `google.protobuf.Struct` (istio/api
//! extensions/v1alpha1/wasm.proto, field 7). istiod's
//! `WasmPluginWrapper.buildPluginConfig` (pilot/pkg/model/extensions.go) turns it
//! into the filter's configuration with `protomarshal.ToJSON`, i.e.
//! `github.com/golang/protobuf/jsonpb.Marshaler{Indent: ""}`, wrapped in a
//! `google.protobuf.StringValue`. So the filter receives compact JSON whose
//! object keys are sorted (a Struct is a proto map) and whose numbers are
//! doubles (a Struct has no integers) printed like Go's `encoding/json`:
//! `60000`, `0.5`, `1e+21` — an integral double has no `.0`, and integers past
//! 2^53 lose precision. [`plugin_config_json`] produces the same string.

use crate::Error;
use serde_norway::Value;

/// Every YAML document in `text` (`---`-separated), empty documents skipped.
pub fn documents(text: &str) -> Result<Vec<Value>, Error> {
    use serde::Deserialize as _;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v = Value::deserialize(doc)?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// The `pluginConfig` of the one WasmPlugin (or `wasm.pluginConfig` of the one TrafficExtension) in `text`,
/// as the JSON string istiod hands the filter.
pub fn plugin_config_json(text: &str, kind: &str) -> Result<String, Error> {
    let docs = documents(text)?;
    let mut found = docs.iter().filter(|d| d.get("kind").and_then(Value::as_str) == Some(kind));
    let doc = found.next().ok_or_else(|| format!("no {kind} in the file"))?;
    if found.next().is_some() {
        return Err(format!("more than one {kind} in the file").into());
    }
    let spec = doc.get("spec").ok_or("no spec")?;
    let config = match kind {
        "TrafficExtension" => spec.get("wasm").and_then(|w| w.get("pluginConfig")),
        _ => spec.get("pluginConfig"),
    };
    let config = config.ok_or("no pluginConfig")?;
    if !config.is_mapping() {
        return Err("pluginConfig must be a mapping (a google.protobuf.Struct)".into());
    }
    struct_json(config)
}

/// `v` as a `google.protobuf.Value` marshalled by jsonpb (compact, sorted keys, doubles).
pub fn struct_json(v: &Value) -> Result<String, Error> {
    let mut out = String::new();
    write_value(v, &mut out)?;
    Ok(out)
}

fn write_value(v: &Value, out: &mut String) -> Result<(), Error> {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&go_double(n.as_f64().ok_or("a number that is not a double")?)?),
        Value::String(s) => write_string(s, out)?,
        Value::Sequence(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(item, out)?;
            }
            out.push(']');
        }
        Value::Mapping(map) => {
            let mut entries = Vec::with_capacity(map.len());
            for (k, v) in map {
                let k = k.as_str().ok_or_else(|| format!("a Struct key must be a string, not {k:?}"))?;
                entries.push((k, v));
            }
            // A Struct's fields are a proto map: jsonpb writes them sorted by key.
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out)?;
                out.push(':');
                write_value(v, out)?;
            }
            out.push('}');
        }
        Value::Tagged(t) => return Err(format!("a YAML tag ({}) has no Struct form", t.tag).into()),
    }
    Ok(())
}

/// Only `"` and `\` are escaped. The Go encoders istiod has used disagree on control characters, `<`, `>`,
/// `&` and U+2028/2029 (`encoding/json` escapes `<>&` as `\u003c`…, protojson does not), so a plugin
/// configuration must not contain them: refused, rather than guessed.
fn write_string(s: &str, out: &mut String) -> Result<(), Error> {
    if let Some(c) = s.chars().find(|c| c.is_control() || matches!(c, '<' | '>' | '&' | '\u{2028}' | '\u{2029}')) {
        return Err(format!("{s:?}: {c:?} is escaped differently by istiod's JSON encoders; keep it out").into());
    }
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Ok(())
}

/// A double the way Go's `encoding/json` (and protojson) print it: the shortest text that reads back as
/// the same double; plain decimal unless |f| < 1e-6 or ≥ 1e21, then `e` notation with a signed exponent
/// (`1e+21`, `1e-7`).
pub fn go_double(f: f64) -> Result<String, Error> {
    if !f.is_finite() {
        return Err(format!("{f} has no JSON form").into());
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-6..1e21).contains(&abs) {
        // Rust's `{:e}` is also the shortest round-trip text; Go writes the exponent's sign always.
        let s = format!("{f:e}");
        return Ok(match s.split_once('e') {
            Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e}"),
            _ => s,
        });
    }
    // Rust's `Display` for f64 is the shortest round-trip text and never uses an exponent.
    Ok(format!("{f}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_print_like_go() -> Result<(), Error> {
        for (f, want) in [
            (60000.0, "60000"),
            (0.5, "0.5"),
            (-0.0, "-0"),
            (0.0, "0"),
            (1e20, "100000000000000000000"),
            (1e21, "1e+21"),
            (1.5e300, "1.5e+300"),
            (1e-7, "1e-7"),
            (0.000001, "0.000001"),
            (123456789.125, "123456789.125"),
            (9007199254740993.0, "9007199254740992"),
        ] {
            assert_eq!(go_double(f)?, want, "{f}");
        }
        assert!(go_double(f64::NAN).is_err());
        Ok(())
    }

    #[test]
    fn a_struct_is_compact_sorted_and_doubles() -> Result<(), Error> {
        let v: Value =
            serde_norway::from_str("b: 1\na: {z: [1, 2.50, true, null], y: \"q\\\"x\"}\nc: 9007199254740993\n")?;
        assert_eq!(struct_json(&v)?, r#"{"a":{"y":"q\"x","z":[1,2.5,true,null]},"b":1,"c":9007199254740992}"#);
        let bad: Value = serde_norway::from_str("a: \"x<y\"")?;
        assert!(struct_json(&bad).is_err(), "<, > and & are refused");
        Ok(())
    }
}
