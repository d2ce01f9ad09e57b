//! JSON parsing that rejects duplicate object keys.
//!
//! serde_json keeps the last of two equal keys; other parsers keep the first.
//! If the filter hashed `{"amount":1,"amount":1000}` as 1000 while the upstream
//! charged 1 (or the reverse), param binding would be bypassed, so a body with
//! duplicate keys is not accepted at all (RFC 8785 and I-JSON forbid them too).

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;

/// With `arbitrary_precision`, serde_json hands a number to visitors as a
/// one-entry map under this key; its own `Value` visitor does the same.
/// The unit test `numbers_keep_their_literal` fails if this ever changes.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

pub fn from_slice(bytes: &[u8]) -> Result<Value, String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = StrictValue.deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(value)
}

#[derive(Clone, Copy)]
struct StrictValue;

impl<'de> DeserializeSeed<'de> for StrictValue {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("number is not finite"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element_seed(StrictValue)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        let mut first = true;
        while let Some(key) = map.next_key::<String>()? {
            if first && key == NUMBER_TOKEN {
                let literal = map.next_value_seed(OwnedLiteral)?;
                let number: Number = literal.parse().map_err(de::Error::custom)?;
                return Ok(Value::Number(number));
            }
            // Anywhere else it is a key only serde_json may write: re-serialised
            // (keys sorted, `$` first) it would turn into a number token.
            if key == NUMBER_TOKEN {
                return Err(de::Error::custom(format_args!("reserved key {key:?}")));
            }
            first = false;
            if object.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key {key:?}")));
            }
            let value = map.next_value_seed(StrictValue)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// serde_json passes a number's literal as an owned `String`, while a real
/// JSON string arrives borrowed. Accepting only the owned form keeps a body
/// that spells the token as an object key from being read as a number the
/// upstream would never see.
struct OwnedLiteral;

impl<'de> DeserializeSeed<'de> for OwnedLiteral {
    type Value = String;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        deserializer.deserialize_string(self)
    }
}

impl<'de> Visitor<'de> for OwnedLiteral {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number")
    }

    fn visit_string<E>(self, v: String) -> Result<String, E> {
        Ok(v)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<String, E> {
        Err(E::custom(format_args!("reserved key {NUMBER_TOKEN:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_their_literal() -> Result<(), String> {
        let v = from_slice(br#"{"a":1.50,"b":[100e-2,-0,12345678901234567890123]}"#)?;
        assert_eq!(v.pointer("/a").map(|n| n.is_number()), Some(true));
        assert_eq!(v.pointer("/a").map(ToString::to_string).as_deref(), Some("1.50"));
        assert_eq!(v.pointer("/b/0").map(ToString::to_string).as_deref(), Some("100e-2"));
        assert_eq!(v.pointer("/b/2").map(ToString::to_string).as_deref(), Some("12345678901234567890123"));
        Ok(())
    }

    #[test]
    fn same_value_as_serde_json_without_duplicates() -> Result<(), String> {
        let text = br#"{"x":{"y":[true,false,null,"s\u00e9",{}]},"z":-1e5,"w":[]}"#;
        let ours = from_slice(text)?;
        let theirs: Value = serde_json::from_slice(text).map_err(|e| e.to_string())?;
        assert_eq!(ours, theirs);
        Ok(())
    }

    #[test]
    fn rejects_duplicates_and_trailing_data() {
        assert!(from_slice(br#"{"a":1,"b":2,"a":3}"#).is_err());
        assert!(from_slice(br#"[{"a":{"k":1,"k":1}}]"#).is_err());
        assert!(from_slice(br#"{"a":1} x"#).is_err());
        assert!(from_slice(br#"{"a":1} "#).is_ok());
    }

    #[test]
    fn the_number_token_cannot_be_smuggled_as_a_key() {
        assert!(from_slice(br#"{"amount":{"$serde_json::private::Number":"1"}}"#).is_err());
        assert!(from_slice(br#"{"amount":{"$serde_json::private::Number":"1\u0030"}}"#).is_err());
        // Found by fuzzing (fuzz/regressions/strict_json): not first is refused too.
        assert!(from_slice(br#"{"amount":{"x":1,"$serde_json::private::Number":"1"}}"#).is_err());
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(from_slice(deep.as_bytes()).is_err());
    }
}
