//! The one piece of protobuf text format the host reads: the route's `Metadata` as Envoy 1.40
//! sends the `xds.route_metadata` attribute (`filter_metadata { key: "ns" value { fields { key: "k"
//! value { string_value: "v" } } } }`). A small reader of that grammar (fields, nested messages,
//! quoted strings with C escapes, numbers), not a general one: anything else reads as no annotation
//! of that shape, and a leaf it cannot read is kept empty so the route's parse refuses it.

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::Value;
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Scalar(Scalar),
    Message(Vec<(String, Node)>),
}

#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    Bytes(Vec<u8>),
    Word(String),
}

struct Reader<'a> {
    s: &'a [u8],
    i: usize,
}

impl Reader<'_> {
    fn skip_ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.i).copied()
    }

    fn word(&mut self) -> Option<String> {
        self.skip_ws();
        let start = self.i;
        while self.s.get(self.i).is_some_and(|b| b.is_ascii_alphanumeric() || b"_.+-".contains(b)) {
            self.i += 1;
        }
        (self.i > start).then(|| String::from_utf8_lossy(self.s.get(start..self.i).unwrap_or_default()).into_owned())
    }

    fn string(&mut self) -> Option<Vec<u8>> {
        let quote = self.peek()?;
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let b = *self.s.get(self.i)?;
            self.i += 1;
            if b == quote {
                return Some(out);
            }
            if b != b'\\' {
                out.push(b);
                continue;
            }
            let e = *self.s.get(self.i)?;
            self.i += 1;
            match e {
                b'n' => out.push(b'\n'),
                b'r' => out.push(b'\r'),
                b't' => out.push(b'\t'),
                b'0'..=b'7' => {
                    let mut v = u32::from(e - b'0');
                    for _ in 0..2 {
                        match self.s.get(self.i) {
                            Some(d @ b'0'..=b'7') => {
                                v = v * 8 + u32::from(d - b'0');
                                self.i += 1;
                            }
                            _ => break,
                        }
                    }
                    out.push(u8::try_from(v).ok()?);
                }
                b'x' => {
                    let hex = self.s.get(self.i..self.i + 2)?;
                    out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
                    self.i += 2;
                }
                other => out.push(other),
            }
        }
    }

    /// Fields until `}` (or the end, at the top level).
    fn message(&mut self, top: bool) -> Option<Vec<(String, Node)>> {
        let mut fields = Vec::new();
        loop {
            match self.peek() {
                None if top => return Some(fields),
                None => return None,
                Some(b'}') if !top => {
                    self.i += 1;
                    return Some(fields);
                }
                _ => {}
            }
            let name = self.word()?;
            let colon = self.peek() == Some(b':');
            if colon {
                self.i += 1;
            }
            let value = match self.peek()? {
                b'{' => {
                    self.i += 1;
                    Node::Message(self.message(false)?)
                }
                b'"' | b'\'' if colon => Node::Scalar(Scalar::Bytes(self.string()?)),
                _ if colon => Node::Scalar(Scalar::Word(self.word()?)),
                _ => return None,
            };
            fields.push((name, value));
        }
    }
}

fn field<'a>(fields: &'a [(String, Node)], name: &str) -> Option<&'a Node> {
    fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

fn message(node: Option<&Node>) -> Option<&[(String, Node)]> {
    match node {
        Some(Node::Message(m)) => Some(m),
        _ => None,
    }
}

fn text(node: Option<&Node>) -> Option<String> {
    match node {
        Some(Node::Scalar(Scalar::Bytes(b))) => String::from_utf8(b.clone()).ok(),
        _ => None,
    }
}

/// A `google.protobuf.Value` in text format, as the leaf it is: a string, a number, else none.
fn leaf(value: &[(String, Node)]) -> Value {
    let kind = if let Some(s) = text(field(value, "string_value")) {
        Some(Kind::StringValue(s))
    } else if let Some(Node::Scalar(Scalar::Word(w))) = field(value, "number_value") {
        w.parse::<f64>().ok().map(Kind::NumberValue)
    } else {
        None
    };
    Value { kind }
}

/// The fields of `namespace` in a route `Metadata` in text format; `None` if it has none.
pub fn route_namespace(text_format: &str, namespace: &str) -> Option<HashMap<String, Value>> {
    let top = Reader { s: text_format.as_bytes(), i: 0 }.message(true)?;
    let entry = top
        .iter()
        .filter(|(n, _)| n == "filter_metadata")
        .filter_map(|(_, v)| message(Some(v)))
        .find(|e| text(field(e, "key")).as_deref() == Some(namespace))?;
    let st = message(field(entry, "value"))?;
    let mut out = HashMap::new();
    for (name, f) in st {
        let Node::Message(f) = f else { continue };
        if name != "fields" {
            continue;
        }
        let Some(key) = text(field(f, "key")) else { continue };
        let value = message(field(f, "value")).map(leaf).unwrap_or(Value { kind: None });
        out.insert(key, value);
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Envoy 1.40 sent for envoy/e2e.yaml's preview route (copied from a run).
    const SENT: &str = r#"filter_metadata { key: "agent_idempotency" value { fields { key: "bind" value { string_value: "/amount:decimal, /currency:string, /payee_id:string" } } fields { key: "fingerprint_ttl_s" value { number_value: 900 } } fields { key: "quote_expires" value { string_value: "/expires_at" } } fields { key: "role" value { string_value: "preview" } } fields { key: "scope" value { string_value: "payments.transfer" } } } } "#;

    #[test]
    fn envoys_route_metadata_reads_as_its_leaves() {
        let ns = route_namespace(SENT, "agent_idempotency").unwrap();
        assert_eq!(ns.len(), 5);
        assert_eq!(ns["role"].kind, Some(Kind::StringValue("preview".into())));
        assert_eq!(
            ns["bind"].kind,
            Some(Kind::StringValue("/amount:decimal, /currency:string, /payee_id:string".into()))
        );
        assert_eq!(ns["fingerprint_ttl_s"].kind, Some(Kind::NumberValue(900.0)));
        assert!(route_namespace(SENT, "other").is_none());
    }

    #[test]
    fn escapes_and_odd_leaves() {
        let t = r#"filter_metadata { key: "agent_idempotency" value { fields { key: "scope" value { string_value: "a\"b\\c\303\251" } } fields { key: "tools" value { struct_value { } } } } }"#;
        let ns = route_namespace(t, "agent_idempotency").unwrap();
        assert_eq!(ns["scope"].kind, Some(Kind::StringValue("a\"b\\cé".into())));
        assert_eq!(ns["tools"].kind, None, "a struct leaf is no leaf: the parse refuses it");
        assert!(route_namespace("filter_metadata { key: ", "agent_idempotency").is_none());
        assert!(route_namespace("", "agent_idempotency").is_none());
    }
}
