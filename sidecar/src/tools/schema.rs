//! The argument schema of one action: the bound fields (required, typed by
//! their bind suffix), `tool.parameters` for the other arguments, and the
//! `fingerprint` a confirm or status call carries.
//!
//! A bound field without a type that `tool.parameters` does not describe
//! gets the empty schema `{}` and a warning: a guess here would teach agents
//! a type the gateway does not check.

use idem_core::canonical::{BoundField, FieldType, Source};
use idem_core::policy::{Role, RoutePolicy};
use serde_json::{json, Map, Value};

/// The JSON Schema (an object schema) of the action's arguments.
pub fn arguments(policy: &RoutePolicy, origin: &str, warnings: &mut Vec<String>) -> Value {
    let mut schema = match policy.tool.as_ref().and_then(|t| t.parameters.clone()) {
        Some(Value::Object(map)) => map,
        _ => Map::new(),
    };
    schema.insert("type".into(), "object".into());
    let props = take_properties(&mut schema);
    restore(&mut schema, props);
    for field in &policy.bound {
        if field.source != Source::Body {
            outside(&mut schema, policy, field, origin, warnings);
            continue;
        }
        let tokens = pointer_tokens(&field.pointer);
        let mut at = Field { origin, pointer: &field.pointer, ty: field.ty, warnings: &mut *warnings };
        at.bind(&mut schema, &tokens);
    }
    if matches!(policy.role, Role::Confirm | Role::Status) {
        if policy.bound.iter().any(|f| f.pointer == "/fingerprint") {
            warnings
                .push(format!("{origin}: bind /fingerprint: the fingerprint cannot be one of its own bound fields"));
        }
        let description = "Exactly as the preview returned it: never invented, edited or reused for other arguments.";
        let mut props = take_properties(&mut schema);
        props.insert("fingerprint".into(), json!({"type": "string", "description": description}));
        restore(&mut schema, props);
        require(&mut schema, "fingerprint");
    }
    Value::Object(schema)
}

/// A bound value outside the body (`path:account`, `query:currency`, `header:x-tenant-id`): an
/// argument of its own name, required, whose description says where the call sends it and that
/// the confirm must send what the preview sent (it is in the fingerprint).
fn outside(
    schema: &mut Map<String, Value>,
    policy: &RoutePolicy,
    field: &BoundField,
    origin: &str,
    warnings: &mut Vec<String>,
) {
    let name = field.name();
    let template = policy.template.as_deref().map(idem_core::policy::template::show).unwrap_or_default();
    let where_sent = match field.source {
        Source::Path => format!("the {{{name}}} segment of the path {template}"),
        Source::Query => format!("the query parameter `{name}`"),
        Source::Header => format!("the `{name}` header"),
        Source::Body => return,
    };
    let description = format!(
        "Sent as {where_sent}, not in the body. Bound into the fingerprint: send exactly what the preview was \
         sent, or the call is refused as params_changed."
    );
    let mut props = take_properties(schema);
    if props.contains_key(name) {
        warnings.push(format!(
            "{origin}: bind {}: an argument {name:?} is described already (a body field?); left as described",
            field.pointer
        ));
        restore(schema, props);
        return;
    }
    let ty = if field.ty == FieldType::Decimal { json!(["string", "number"]) } else { json!("string") };
    props.insert(name.to_owned(), json!({"type": ty, "description": description, "x-agent-idempotency-in": field.source.prefix().trim_end_matches(':')}));
    restore(schema, props);
    require(schema, name);
}

/// `/payee/id` → `["payee", "id"]`, with `~1` and `~0` decoded.
fn pointer_tokens(pointer: &str) -> Vec<String> {
    pointer.split('/').skip(1).map(|t| t.replace("~1", "/").replace("~0", "~")).collect()
}

/// Takes the `properties` object out (a fresh one if absent); put it back with `restore`.
fn take_properties(schema: &mut Map<String, Value>) -> Map<String, Value> {
    match schema.remove("properties") {
        Some(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

fn restore(schema: &mut Map<String, Value>, properties: Map<String, Value>) {
    schema.insert("properties".into(), Value::Object(properties));
}

fn require(schema: &mut Map<String, Value>, name: &str) {
    let slot = schema.entry("required").or_insert_with(|| json!([]));
    if !slot.is_array() {
        *slot = json!([]);
    }
    if let Value::Array(names) = slot {
        if !names.iter().any(|n| n == name) {
            names.push(name.into());
        }
    }
}

/// The schema a bind suffix stands for.
fn typed(ty: FieldType) -> Option<Value> {
    Some(match ty {
        FieldType::Any => return None,
        FieldType::Decimal => json!(["string", "number"]),
        FieldType::String => json!("string"),
        FieldType::Integer => json!("integer"),
        FieldType::Number => json!("number"),
        FieldType::Boolean => json!("boolean"),
    })
}

struct Field<'a> {
    origin: &'a str,
    pointer: &'a str,
    ty: FieldType,
    warnings: &'a mut Vec<String>,
}

impl Field<'_> {
    /// Walk (or create) the nested objects down to the field; every level is required.
    fn bind(&mut self, schema: &mut Map<String, Value>, tokens: &[String]) {
        let Some((name, rest)) = tokens.split_first() else { return };
        require(schema, name);
        let mut props = take_properties(schema);
        if rest.is_empty() {
            let described = props.remove(name);
            props.insert(name.clone(), self.leaf(described));
        } else {
            match props.entry(name.clone()).or_insert_with(|| json!({"type": "object"})) {
                Value::Object(child) if child.get("type").is_none_or(|t| t == "object") => {
                    child.insert("type".into(), "object".into());
                    self.bind(child, rest);
                }
                _ => self.warnings.push(format!(
                    "{}: bind {}: tool.parameters describes {name:?} as something other than an object; left as described",
                    self.origin, self.pointer
                )),
            }
        }
        restore(schema, props);
    }

    fn leaf(&mut self, described: Option<Value>) -> Value {
        let described = match described {
            Some(Value::Object(map)) => Some(map),
            _ => None,
        };
        let Some(ty) = typed(self.ty) else {
            return match described {
                Some(map) if !map.is_empty() => Value::Object(map),
                _ => {
                    self.warnings.push(format!(
                        "{}: bind {} has no type; add a type suffix such as :string or describe it in tool.parameters",
                        self.origin, self.pointer
                    ));
                    json!({})
                }
            };
        };
        let mut map = described.unwrap_or_default();
        if let Some(declared) = map.get("type").filter(|d| **d != ty) {
            // The gateway checks the bind type; a schema saying otherwise would make agents fail.
            self.warnings.push(format!(
                "{}: bind {}: tool.parameters says type {declared}, the bind suffix :{}; using the bind type",
                self.origin,
                self.pointer,
                self.ty.suffix().unwrap_or_default()
            ));
        }
        map.insert("type".into(), ty);
        if self.ty == FieldType::Decimal && !map.contains_key("description") {
            map.insert("description".into(), "a decimal amount, e.g. \"12.50\"".into());
        }
        Value::Object(map)
    }
}
