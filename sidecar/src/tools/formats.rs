//! One definition, three shapes: OpenAI function calling, Anthropic tool
//! use, MCP `tools/list` entries.

use serde_json::{json, Value};

use crate::config::tools::ToolFormat;

#[derive(Debug, Clone, PartialEq)]
pub struct Definition {
    pub name: String,
    pub description: String,
    /// The arguments' JSON Schema (an object schema).
    pub parameters: Value,
    /// Preview and status change nothing; confirm executes (once per fingerprint).
    pub read_only: bool,
}

pub fn openai(d: &Definition) -> Value {
    json!({"type": "function", "function": {"name": d.name, "description": d.description, "parameters": d.parameters}})
}

pub fn anthropic(d: &Definition) -> Value {
    json!({"name": d.name, "description": d.description, "input_schema": d.parameters})
}

/// With MCP's behaviour hints: a confirm is idempotent per fingerprint, which
/// is the point of the gateway.
pub fn mcp(d: &Definition) -> Value {
    let annotations = if d.read_only {
        json!({"readOnlyHint": true})
    } else {
        json!({"readOnlyHint": false, "idempotentHint": true})
    };
    json!({"name": d.name, "description": d.description, "inputSchema": d.parameters, "annotations": annotations})
}

/// One format's array, or all three in one object.
pub fn render(definitions: &[Definition], format: Option<ToolFormat>) -> Value {
    let list = |shape: fn(&Definition) -> Value| Value::Array(definitions.iter().map(shape).collect());
    match format {
        Some(ToolFormat::Openai) => list(openai),
        Some(ToolFormat::Anthropic) => list(anthropic),
        Some(ToolFormat::Mcp) => list(mcp),
        None => json!({"openai": list(openai), "anthropic": list(anthropic), "mcp": list(mcp)}),
    }
}
