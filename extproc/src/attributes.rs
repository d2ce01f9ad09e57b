//! What Envoy tells the processor beside the headers: the attributes it was configured to send
//! (`request_attributes: [xds.route_metadata, …]`, `response_attributes: [response.code_details]`)
//! and forwarded dynamic metadata. Read into the forms the adapter takes from the filter hosts:
//! the route's annotation as `policy::encode_pairs` bytes (strings as their bytes, numbers as
//! 8 little-endian bytes of a double, the encoding route metadata reaches the `.wasm` in), and
//! properties as bytes.

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use idem_core::policy::{self, ROUTE_NAMESPACE};
use std::collections::HashMap;

/// The key Envoy files the attributes of the ext_proc filter under.
#[cfg(test)]
const EXT_PROC_FILTER: &str = "envoy.filters.http.ext_proc";
/// The attribute that carries the route's metadata.
pub const ROUTE_METADATA: &str = "xds.route_metadata";

/// Every attribute Envoy sent, flattened: `(name, value)`, a string as its bytes, a number as its
/// decimal text. The route's metadata is read apart (`annotation`).
pub fn flatten(attributes: &HashMap<String, Struct>) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for set in attributes.values() {
        for (name, value) in &set.fields {
            let bytes = match &value.kind {
                Some(Kind::StringValue(s)) => s.as_bytes().to_vec(),
                Some(Kind::NumberValue(n)) => n.to_string().into_bytes(),
                Some(Kind::BoolValue(b)) => b.to_string().into_bytes(),
                _ => continue,
            };
            out.push((name.clone(), bytes));
        }
    }
    out
}

/// The route's `agent_idempotency` annotation, if the route has one: `Some(bytes)` as the adapter's
/// route cache keys it, leaves sorted so equal annotations are equal bytes.
pub fn annotation(attributes: &HashMap<String, Struct>) -> Option<Vec<u8>> {
    let value = attributes.values().find_map(|s| s.fields.get(ROUTE_METADATA))?;
    let fields = namespace_of(value)?;
    let mut leaves: Vec<(String, Vec<u8>)> = fields
        .iter()
        .map(|(key, v)| {
            let bytes = match &v.kind {
                Some(Kind::StringValue(s)) => s.as_bytes().to_vec(),
                Some(Kind::NumberValue(n)) => n.to_le_bytes().to_vec(),
                // A list or a struct is no annotation leaf: kept empty, so the parse refuses it
                // (as the native module does), never skipped.
                _ => Vec::new(),
            };
            (key.clone(), bytes)
        })
        .collect();
    leaves.sort();
    let pairs: Vec<(&str, &[u8])> = leaves.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    Some(policy::encode_pairs(&pairs))
}

/// The annotation's fields inside the route metadata attribute. Envoy 1.40 sends the `Metadata`
/// message in protobuf text format (`filter_metadata { key: "agent_idempotency" value { fields { … } } }`);
/// a struct value (`{filter_metadata: {agent_idempotency: {…}}}`) is read too.
fn namespace_of(value: &Value) -> Option<HashMap<String, Value>> {
    if let Some(Kind::StringValue(text)) = &value.kind {
        return crate::text_format::route_namespace(text, ROUTE_NAMESPACE);
    }
    let Some(Kind::StructValue(metadata)) = &value.kind else { return None };
    let Some(Kind::StructValue(filters)) = metadata.fields.get("filter_metadata").and_then(|v| v.kind.as_ref()) else {
        return None;
    };
    match filters.fields.get(ROUTE_NAMESPACE).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StructValue(ns)) if !ns.fields.is_empty() => Some(ns.fields.clone()),
        _ => None,
    }
}

/// A string in forwarded dynamic metadata (what `metadata_options` sends): `path` is the namespace,
/// then keys into nested structs (`["envoy.filters.http.jwt_authn", "payload", "sub"]`), where a
/// `subject.property` of `["metadata", "filter_metadata", …]` points.
pub fn dynamic_metadata(metadata: Option<&Metadata>, path: &[&str]) -> Option<String> {
    let (ns, keys) = path.split_first()?;
    let mut fields = &metadata?.filter_metadata.get(*ns)?.fields;
    let (last, inner) = keys.split_last()?;
    for key in inner {
        match &fields.get(*key)?.kind {
            Some(Kind::StructValue(s)) => fields = &s.fields,
            _ => return None,
        }
    }
    match &fields.get(*last)?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(s: &str) -> Value {
        Value { kind: Some(Kind::StringValue(s.into())) }
    }

    fn object(fields: Vec<(&str, Value)>) -> Value {
        Value {
            kind: Some(Kind::StructValue(Struct {
                fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            })),
        }
    }

    #[test]
    fn the_annotation_is_the_bytes_route_metadata_gives_the_wasm() {
        let ns = object(vec![
            ("role", string("confirm")),
            ("scope", string("payments")),
            ("lease_ms", Value { kind: Some(Kind::NumberValue(2000.0)) }),
        ]);
        let metadata = object(vec![("filter_metadata", object(vec![(ROUTE_NAMESPACE, ns)]))]);
        let attrs: HashMap<String, Struct> = [(
            EXT_PROC_FILTER.to_owned(),
            Struct { fields: [(ROUTE_METADATA.to_owned(), metadata)].into_iter().collect() },
        )]
        .into_iter()
        .collect();
        let want =
            policy::encode_pairs(&[("lease_ms", &2000f64.to_le_bytes()), ("role", b"confirm"), ("scope", b"payments")]);
        assert_eq!(annotation(&attrs), Some(want));
    }

    #[test]
    fn a_route_without_the_namespace_has_no_annotation() {
        let metadata = object(vec![("filter_metadata", object(vec![("other", object(vec![("a", string("b"))]))]))]);
        let attrs: HashMap<String, Struct> = [(
            EXT_PROC_FILTER.to_owned(),
            Struct { fields: [(ROUTE_METADATA.to_owned(), metadata)].into_iter().collect() },
        )]
        .into_iter()
        .collect();
        assert_eq!(annotation(&attrs), None);
        assert_eq!(annotation(&HashMap::new()), None);
    }
}
